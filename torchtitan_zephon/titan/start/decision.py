"""The start decision: what a job starts from, and the checkpoint TorchTitan will load.

Role: ``choose_checkpoint`` finds the checkpoint TorchTitan will load, by its own
rule (``checkpoint.enable``, ``checkpoint.load_step``, else the newest ``step-N``
with a DCP ``.metadata`` under ``dump_folder/checkpoint.folder``: ``titan_load_step``),
and passes over checkpoints whose files are incomplete or corrupt; it also checks
``checkpoint.initial_load_path`` where TorchTitan would take it, names a 0.2.2
checkpoint's key map (``check_old_run``, which refuses one that does not map), and,
after an explicit ``checkpoint.load_step`` K, lists the checkpoints after K that the
trainer moves aside (``StartDecision.abandoned``). The preflight (``titan.start.preflight``)
fills the rest of the ``StartDecision`` and runs the other checks.

Invariant: the choice only reads, and is a pure function of the job and the files,
so every rank reaches the same one; ``StartDecision.load_step`` is what the trainer pins
in TorchTitan's ``checkpoint.load_step`` so that it loads exactly the checkpoint
that was checked. Where TorchTitan would load a checkpoint that cannot be loaded,
the start is refused (``StartRefused``) instead.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.migrate import old_runs
from torchtitan_zephon.order.data_config import DataConfig, DataStateMismatch
from torchtitan_zephon.order.state import DataState
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.titan.settings.job_view import JobView


def with_trainer_hint(e: DataStateMismatch) -> DataStateMismatch:
    """A refused resume, with how to opt in from the trainer's command line."""
    names = list(e.fields) or ["FIELD"]
    return DataStateMismatch(
        f"{e}\nWith the trainer: --zephon.allow_changes {' '.join(names)} (TOML: [zephon] "
        f"allow_changes = {json.dumps(names)}). Nothing was changed on disk.",
        e.fields,
    )


class StartRefused(RuntimeError):
    """The job would not continue its run folder's history correctly: nothing was written."""


@dataclass
class StartDecision:
    """What the job starts from."""

    resume: runs.CheckpointInfo | None = None
    """The checkpoint whose training and data state the job continues (None: step 1)."""
    state: DataState | None = None
    """Its Zephon data state."""
    skipped: list[runs.CheckpointInfo] = field(default_factory=list)
    """Newer checkpoints passed over: incomplete or corrupt."""
    notes: list[str] = field(default_factory=list)
    """What rank 0 tells the user before training."""
    data: JobData | None = None
    """The job's data, opened and checked by the preflight: the trainer hands this
    object to the dataloader and the validator, so no store is opened twice."""
    data_config: DataConfig | None = None
    """The job's data config over ``data``, built once by the preflight and handed on
    with it."""
    load_step: int | None = None
    """The step TorchTitan must load (its ``checkpoint.load_step``), when the job's -1
    (the newest) resolved to a checked checkpoint; None: leave it as it is."""
    abandoned: list[runs.CheckpointInfo] = field(default_factory=list)
    """A rollback's abandoned branch: with an explicit ``checkpoint.load_step`` K, the
    checkpoints after K. Rank 0 moves them out of the checkpoint folder at the first step,
    once every rank has loaded K (``ZephonTrainer``), so no later automatic resume
    (TorchTitan takes the newest) picks them, and no ``keep_latest_k`` purge weighs them."""
    old_run: old_runs.OldCheckpoint | None = None
    """The key map of the checkpoint TorchTitan loads (a resume, or model only) when the
    0.2.2-based code wrote it (``migrate.old_runs``)."""


StartPlan = StartDecision  # its name before 'plan' meant the order only


# ---------------------------------------------------------------- TorchTitan's rule


def titan_load_step(folder: Path) -> int:
    """The step TorchTitan's ``CheckpointManager._find_load_step`` picks in ``folder``
    (any entry whose name *contains* ``step-N`` and that holds a DCP ``.metadata`` or a
    safetensors index), or -1. TorchTitan has no public API for it: this is the one
    copy of the rule, and tests/titan/test_load_step.py pins it to TorchTitan's."""
    if not folder.is_dir():
        return -1
    steps = []
    for name in os.listdir(folder):
        m = re.search(r"step-(\d+)", name)
        if m and (
            (folder / name / ".metadata").is_file()
            or (folder / name / "model.safetensors.index.json").is_file()
        ):
            steps.append(int(m.group(1)))
    return max(steps, default=-1)


def _listing(found: list[runs.CheckpointInfo]) -> str:
    return ", ".join(f"step-{c.step} ({c.status})" for c in found) or "none"


def choose_checkpoint(job: JobView) -> tuple[runs.CheckpointInfo | None, StartDecision, str]:
    """(checkpoint TorchTitan will load or None, the start decision with skipped ones, why none).

    Sets ``start.load_step`` to the chosen step when ``checkpoint.load_step`` was -1
    (the newest), ``start.abandoned`` after an explicit one, ``start.old_run`` for a
    0.2.2 checkpoint. Raises StartRefused when TorchTitan would load something that
    cannot be loaded.
    """
    ck = job.checkpoint
    dump = Path(job.dump_folder)
    folder = dump / ck.folder
    start = StartDecision()
    if not ck.enable:
        return None, start, "checkpoint.enable is false"
    path = ck.initial_load_path
    # TorchTitan's rule: the initial load when its newest-checkpoint rule finds nothing
    # (no folder, or only incomplete step folders) and no step is named.
    if not folder.exists() or (path and ck.load_step < 0 and titan_load_step(folder) == -1):
        if path and "://" in str(path):  # a remote URI (TorchTitan's fsspec reader)
            if not ck.initial_load_model_only:
                raise StartRefused(
                    f"checkpoint.initial_load_path {path} is a remote URI: Zephon resumes a "
                    "run (its data state and sequence log) only from a checkpoint on a local "
                    "or shared filesystem. Copy it there, or load its model only "
                    "(--checkpoint.initial_load_model_only)."
                )
            start.notes.append(
                f"checkpoint.initial_load_path {path} is a remote URI, loaded model only: "
                "TorchTitan reads it; Zephon does not check it before the start"
            )
            return None, start, f"--checkpoint.initial_load_path {path} is loaded model only"
        if path and not ck.initial_load_in_hf:
            info = runs.verify_checkpoint(
                runs.CheckpointInfo(-1, Path(path), (Path(path) / ".metadata").is_file(), 0)
            )
            if info.status != "complete":
                raise StartRefused(
                    f"checkpoint.initial_load_path {path} is {info.status}"
                    f"{': ' + info.problem if info.problem else ' (no DCP .metadata)'}; it "
                    "cannot be loaded. Point it at a complete checkpoint."
                )
            if not ck.initial_load_model_only:
                return info, start, ""
            check_old_run(info, start, job)
            return None, start, f"--checkpoint.initial_load_path {path} is loaded model only"
        return None, start, f"it has no checkpoint folder {folder}"
    found = runs.checkpoints(dump, ck.folder)
    by_step = {c.step: c for c in found}
    if ck.load_step >= 0:  # an explicit step: TorchTitan loads exactly that folder
        info = by_step.get(ck.load_step)
        if info is None:
            raise StartRefused(
                f"--checkpoint.load_step={ck.load_step} but {folder / f'step-{ck.load_step}'} "
                f"does not exist; checkpoints there: {_listing(found)}"
            )
        runs.verify_checkpoint(info)
        if info.status != "complete":
            why = info.problem or "no DCP .metadata: the job died while writing it"
            raise StartRefused(
                f"--checkpoint.load_step={ck.load_step} names checkpoint {info.path}, which is "
                f"{info.status} ({why}). Choose another: {_listing(found)}"
            )
        if ck.load_step == 0:
            check_old_run(info, start, job)
            return None, start, "checkpoint.load_step = 0 loads only the model of step-0"
        start.abandoned = [c for c in found if c.step > ck.load_step]
        return info, start, ""
    titan_step = titan_load_step(folder)
    chosen = None
    for info in sorted(found, key=lambda c: -c.step):
        if not info.complete:
            if (info.path / "model.safetensors.index.json").is_file():
                info.holds, chosen = "model", info  # TorchTitan would load this export
                break
            start.skipped.append(info)
            continue
        runs.verify_checkpoint(info)
        if info.problem:
            start.skipped.append(info)
            continue
        chosen = info
        break
    if chosen is None:
        if titan_step != -1:
            problems = [f"step-{c.step}: {c.problem}" for c in start.skipped if c.problem]
            raise StartRefused(
                f"no checkpoint in {folder} can be loaded ({_listing(found)}"
                f"{''.join('; ' + p for p in problems)}), but TorchTitan would try step "
                f"{titan_step}. Move the broken folders out of "
                f"{folder} (TorchTitan counts any name that contains step-<N>), or use "
                "another --dump_folder."
            )
        return None, start, f"{folder} holds no complete checkpoint"
    start.skipped = [c for c in start.skipped if c.step > chosen.step]
    start.load_step = chosen.step  # TorchTitan loads what was checked, on every rank
    if chosen.step == 0:
        check_old_run(chosen, start, job)
        return None, start, "its only checkpoint is the seed checkpoint step-0 (model only)"
    return chosen, start, ""


def check_old_run(info: runs.CheckpointInfo, start: StartDecision, job: JobView) -> None:
    """A checkpoint TorchTitan will load (a resume, or model only): when the 0.2.2-based
    code wrote it, ``start.old_run`` is its name map, and a note says so (StartRefused
    when it does not map)."""
    try:
        start.old_run = old_runs.check(info, job)
    except old_runs.OldRunRefused as e:
        raise StartRefused(str(e)) from None
    if start.old_run is not None:
        start.notes.append(start.old_run.describe())
