"""Reading a run folder (a TorchTitan ``job.dump_folder``) after the fact.

A run folder holds ``checkpoint/step-N`` (DCP), ``tb/<time>/events.*``
(TensorBoard), ``zephon/sequence_log.jsonl`` (the tracker), when launched
by our scripts a training log, and the job config if it was saved with
``--job.save_config_file``. Every job that wrote into the folder, the
original one and each resume, left its own event file.

Invariant: the *effective* value of a metric at step ``s`` is the one written
last (by wall time): a resumed job rewrites the steps after its checkpoint and
supersedes what the interrupted job wrote for them, exactly as the sequence log
does.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_zephon.order.data_config import DataStateMismatch
from torchtitan_zephon.order.state import RECORD_KEY, DataState
from torchtitan_zephon.tracker import LOG_NAME, LogContents, LogReader, TrackerError, read_log
from torchtitan_zephon.tracker.forked import ForkedLogReader
from torchtitan_zephon.tracker.reader import resolve as resolve_log

LOSS_TAG = "loss_metrics/global_avg_loss"
_LOG_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+0-9.eEnaif]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class RunError(ValueError):
    """A run folder is missing or unreadable."""


def require_run(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise RunError(f"run folder {p} does not exist (expected a TorchTitan job.dump_folder)")
    return p


def event_files(run: str | os.PathLike) -> list[Path]:
    return sorted(Path(run).glob("tb/**/events.out.tfevents.*"))


def read_scalars(run: str | os.PathLike, tag: str = LOSS_TAG) -> dict[int, float]:
    """Effective ``step -> value`` of a TensorBoard scalar across every job of the run."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    latest: dict[int, tuple[float, float]] = {}
    for f in event_files(run):
        try:
            for event in EventFileLoader(str(f)).Load():
                for v in event.summary.value:
                    if v.tag != tag:
                        continue
                    value = (
                        v.simple_value
                        if v.HasField("simple_value")
                        else (v.tensor.float_val[0] if v.tensor.float_val else float("nan"))
                    )
                    prev = latest.get(event.step)
                    if prev is None or event.wall_time >= prev[0]:
                        latest[event.step] = (event.wall_time, float(value))
        except Exception as e:  # a truncated event file ends early; keep what was read
            if not latest:
                raise RunError(f"cannot read TensorBoard events {f}: {e}") from None
    return {s: v for s, (_, v) in sorted(latest.items())}


def read_log_losses(log_file: str | os.PathLike) -> dict[int, float]:
    """``step -> loss`` from TorchTitan's console log (``step: N  loss: X``), last one wins.

    Only 5 decimals are printed there: prefer TensorBoard events.
    """
    out: dict[int, float] = {}
    with open(log_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "validate" in line:
                continue
            m = _LOG_LOSS.search(_ANSI.sub("", line))
            if m:
                out[int(m.group(1))] = float(m.group(2))
    return out


def losses(run: str | os.PathLike) -> tuple[dict[int, float], str]:
    """The run's training loss by step and where it came from ("tensorboard" or a log file)."""
    run = require_run(run)
    if event_files(run):
        values = read_scalars(run)
        if values:
            return values, "tensorboard"
    for name in ("train.log", "training.log", "log.txt"):
        if (run / name).is_file():
            values = read_log_losses(run / name)
            if values:
                return values, str(run / name)
    raise RunError(
        f"no losses in {run}: no TensorBoard events under tb/ (enable with "
        "--metrics.enable_tensorboard) and no train.log"
    )


CHECKPOINT_NAME = re.compile(r"step-(\d+)")
"""A checkpoint folder's name: ``step-N`` (TorchTitan saves and loads that name)."""
DATA_STATE_KEY = f"dataloader.{RECORD_KEY}"
"""Where DCP keeps the Zephon record in a checkpoint."""


@dataclass
class CheckpointInfo:
    step: int
    path: Path
    complete: bool
    """DCP wrote its ``.metadata`` file last: a folder without it was interrupted."""
    bytes: int
    problem: str | None = None
    """Why a complete checkpoint cannot be loaded: an unreadable ``.metadata``, a shard
    missing or shorter than ``.metadata`` says (None: whole, or not verified)."""
    holds: str | None = None
    """What a whole checkpoint holds: ``"training"`` (model, optimizer, trainer and the
    Zephon data state: a job can resume from it), ``"model"`` (the weights only, e.g.
    TorchTitan's last checkpoint with ``checkpoint.last_save_model_only``), or
    ``"no data state"`` (a training checkpoint without the Zephon record, e.g. stock
    TorchTitan's). None: not verified, incomplete or corrupt."""
    keys: frozenset[str] = frozenset()
    """The state-dict keys its ``.metadata`` lists (verified checkpoints)."""

    @property
    def status(self) -> str:
        """``complete``, ``incomplete`` (no .metadata) or ``corrupt`` (see ``problem``)."""
        if not self.complete:
            return "incomplete"
        return "corrupt" if self.problem else "complete"

    @property
    def resumable(self) -> bool:
        """Verified whole and holding everything a training job resumes from."""
        return self.complete and self.problem is None and self.holds == "training"


def checkpoints(
    run: str | os.PathLike, folder: str = "checkpoint", *, verify: bool = False
) -> list[CheckpointInfo]:
    """The ``step-N`` folders of a run's checkpoint folder, by step.

    ``verify``: also read each complete one's ``.metadata`` and check its shards
    (see :func:`verify_checkpoint`); otherwise only ``complete`` is known.
    """
    root = Path(run) / folder
    out = []
    if not root.is_dir():
        return out
    for child in root.iterdir():
        m = CHECKPOINT_NAME.fullmatch(child.name)
        if m and child.is_dir():
            size = sum(f.stat().st_size for f in child.rglob("*") if f.is_file())
            info = CheckpointInfo(int(m.group(1)), child, (child / ".metadata").is_file(), size)
            out.append(verify_checkpoint(info) if verify else info)
    return sorted(out, key=lambda c: c.step)


def verify_checkpoint(info: CheckpointInfo) -> CheckpointInfo:
    """Fill in ``problem``, ``holds`` and ``keys`` from the files: a pure function of the
    checkpoint folder, so every rank that asks reaches the same verdict.

    A shard is whole when its size covers every byte range (offset + length) that
    ``.metadata`` assigns to it; DCP writes ``.metadata`` last, so a folder with it and a
    short shard was damaged afterwards (a full disk, a copy cut short, a bad node).
    Content changed in place at the same size is not detected (DCP keeps no checksums).
    """
    if not info.complete:
        return info
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(info.path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in many ways
        info.problem = f".metadata is unreadable ({type(e).__name__}: {e or 'cut short'})"
        return info
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        end = int(item.offset) + int(item.length)
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        shard = info.path / name
        if not shard.is_file():
            info.problem = f"shard {name} is missing"
            return info
        size = shard.stat().st_size
        if size < end:
            info.problem = (
                f"shard {name} is truncated: {size} bytes, its .metadata needs at least {end}"
            )
            return info
    keys = frozenset(metadata.state_dict_metadata)
    info.keys = keys
    if DATA_STATE_KEY in keys:
        info.holds = "training"
    elif any(k == "train_state" or k.split(".")[0] in TRAINING_STATES for k in keys):
        info.holds = "no data state"
    else:
        info.holds = "model"
    return info


TRAINING_STATES = ("train_state", "optimizer", "lr_scheduler", "dataloader")
"""TorchTitan's checkpoint entries besides the model (a model-only checkpoint has none)."""


def read_data_state(checkpoint: str | os.PathLike) -> DataState:
    """The Zephon record (data state + tracker head) saved in a DCP checkpoint folder."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = FileSystemReader(str(checkpoint))
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise RunError(f"{checkpoint} is not a complete DCP checkpoint (no .metadata)") from None
    key = DATA_STATE_KEY
    if not isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
        raise RunError(f"{checkpoint} holds no Zephon data state (key {key!r} missing)")
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {key: ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, storage_reader=reader, no_dist=True)
    try:
        return DataState.from_json(state[key])
    except DataStateMismatch as e:
        raise RunError(f"{checkpoint}: {e}") from None


# ---------------------------------------------------------------- sequence log

TOPOLOGY_KEYS = (
    "world_size", "dp_degree", "nnodes", "tp_degree", "local_batch_size", "replica_id",
    "group_size", "reproducible",
)  # fmt: skip
"""The fields of a start / resume event that describe the job's topology (and
``reproducible``: the job ran with ``zephon.reproducible``, absent otherwise)."""


def sequence_log(path: str | os.PathLike) -> LogContents:
    """The effective sequence log of a run folder, or of a log file given directly.

    Raises RunError (a ValueError) with what was expected when the path is missing
    or the log is corrupt.
    """
    p = Path(path)
    if not p.exists():
        raise RunError(
            f"{p} does not exist: expected a run folder (TorchTitan job.dump_folder) or its "
            f"zephon/{LOG_NAME}"
        )
    try:
        return read_log(p)
    except TrackerError as e:
        raise RunError(str(e)) from None
    # e.g. a record whose "step" is not a number (ValueError) or is 1e400 (OverflowError),
    # or a line of JSON nested too deeply to parse (RecursionError)
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise RunError(f"{p}: the sequence log is corrupt ({type(e).__name__}: {e})") from None


FORK_LOG_BYTES = 16 << 20
"""Logs at least this large (~70,000 steps) are read in a child process when asked."""


def log_reader(path: str | os.PathLike, *, forked: bool = False) -> LogReader:
    """A streaming reader of a run's sequence log (events read, records not yet);
    ``forked``: a large log is read in a child process (two logs on two cores).

    Raises RunError (a ValueError) with what was expected when the path is missing
    or an event line is corrupt; record lines are checked as they are streamed.
    """
    p = Path(path)
    if not p.exists():
        raise RunError(
            f"{p} does not exist: expected a run folder (TorchTitan job.dump_folder) or its "
            f"zephon/{LOG_NAME}"
        )
    try:
        if forked and resolve_log(p).stat().st_size >= FORK_LOG_BYTES:
            return ForkedLogReader(p)
        return LogReader(p)
    except TrackerError as e:
        raise RunError(str(e)) from None


FT_KEYS = ("replica_id", "group_size")
"""The topology fields of a torchft replica group's events."""


def topology(event: dict[str, Any]) -> dict[str, Any]:
    """``from_step`` and the topology fields of a start / resume event (absent ones omitted)."""
    out = {"event": event.get("event"), "from_step": event.get("from_step")}
    out.update({k: event[k] for k in TOPOLOGY_KEYS if k in event})
    return out


def format_topology(event: dict[str, Any]) -> str:
    """``world_size 2, dp_degree 2, nnodes 2, ...`` for humans."""
    named = [k for k in TOPOLOGY_KEYS if k in event and k not in (*FT_KEYS, "reproducible")]
    parts = [f"{k} {event[k]}" for k in named]
    if event.get("reproducible"):
        parts.append("zephon.reproducible")
    if all(k in event for k in FT_KEYS):
        parts.append(
            f"torchft replica group {event['replica_id']} of group_size {event['group_size']}"
        )
    return ", ".join(parts) if parts else "topology not recorded"


def resumes(contents: LogContents | LogReader) -> list[dict[str, Any]]:
    """The resume events of the effective history, in order, as :func:`topology` records.

    A start event begins a new history: resumes logged before it no longer count.
    """
    out: list[dict[str, Any]] = []
    for e in contents.events:
        if e.get("event") == "start":
            out = []
        elif e.get("event") == "resume":
            out.append(topology(e))
    return out


def skips(contents: LogContents | LogReader) -> list[dict[str, Any]]:
    """The skip events of the effective history, in order, as ``{"step", "steps",
    "from_step"}``: a start event begins a new history, and a resume from step k drops
    the skips of steps after k (trained again, a kept entry is logged again)."""
    out: list[dict[str, Any]] = []
    for e in contents.events:
        kind, k = e.get("event"), e.get("from_step")
        if kind == "start":
            out = []
        elif kind == "resume" and isinstance(k, int):
            out = [s for s in out if s["from_step"] < k]
        elif kind == "skip":
            out.append({key: e.get(key) for key in ("step", "steps", "from_step")})
    return out


def saved_config(run: str | os.PathLike) -> tuple[Path, dict] | None:
    """The job config a run saved, if any: TorchTitan 0.2.2's ``--job.save_config_file
    NAME.json`` (sections ``job``, ``training``, ...) or 0.3's ``--debug.save_config_file``
    (``dump_folder`` and ``hf_assets_path`` at the top, no ``job`` section)."""
    for f in sorted(Path(run).glob("*.json")):
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue
        if (
            isinstance(data, dict)
            and "training" in data
            and ("job" in data or "dump_folder" in data)
        ):
            return f, data
    return None
