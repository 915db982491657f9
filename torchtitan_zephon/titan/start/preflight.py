"""Preflight: what a job will start from, decided (and refused) before anything is written.

Role: before TorchTitan's Trainer builds anything (TensorBoard writer, sequence
log, checkpoints), find the checkpoint TorchTitan will load, by its own rule,
passing over checkpoints whose files are incomplete or corrupt
(``titan.start.decision``), and run every check that can refuse the start:

* the data config against the checkpoint's data state (``job.plans.decide_resume``),
* the sequence log against the checkpoint's chain head (global rank 0),
* a checkpoint that cannot be resumed (model-only, no Zephon data state, data
  state excluded from loading), and one written by the 0.2.2-based code whose keys
  do not map onto the job's (``migrate.old_runs``: only llama3 maps),
* a run folder that holds a history (sequence log steps, checkpoints) the job
  would not resume from, unless ``zephon.start_over``, an elastic restart of
  the same job, or a requeue: no whole checkpoint, and a log that records only
  this job's data config (the same command run again after a kill before the
  first checkpoint starts from step 1, with nothing to decide),
* the store against the model and tokenizer (a tokenizer TorchTitan cannot load
  from ``hf_assets_path`` is refused naming the path and the tokenizer the
  store was prepared with), its size, the held-out samples validation reads
  (validation on), ``zephon.skip_steps`` (malformed: refused; an entry after
  ``training.steps``: a warning), ``zephon.exclude`` (a file that cannot be read or
  parsed, ids outside the training samples, held-out ids, a source the data does not
  have, a list that leaves a source empty: refused, naming the line; an entry after
  ``training.steps``: a warning), and the global batch layout;
  where ``zephon.store`` (or a mixture source) names raw inputs they are prepared
  here, into the cache (``ingest.cache``), before TorchTitan initializes the process
  group: no collective waits on the tokenization, and a missing input or
  tokenizer.json is refused before anything is written.

The job's data is opened here, once per process: ``StartDecision.data`` is the
object the trainer hands to the dataloader and the validator.

Invariants:
- ``decide_start`` only reads (the job's view, ``titan.settings.job_view``, and the files):
  a refused start leaves the run folder as it was.
- The choice of checkpoint is a pure function of the job and the files, so every
  rank reaches the same one, and the one TorchTitan loads (``titan.start.decision``).
- The dataloader and tracker keep their own checks as a second line (on the
  same job-data object, never a reopened store); the preflight refuses the same
  cases with the same messages, earlier.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

from torchtitan_zephon.job.data import JobData
from torchtitan_zephon.job.plans import decide_resume
from torchtitan_zephon.job.settings import builtin_tokenizer
from torchtitan_zephon.order.data_config import DataConfig, DataStateMismatch
from torchtitan_zephon.order.resume import allowed_fields
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.titan.settings.job_view import JobView
from torchtitan_zephon.titan.start.decision import (
    StartDecision,
    StartRefused,
    check_old_run,
    choose_checkpoint,
    with_trainer_hint,
)
from torchtitan_zephon.titan.start.job_data import (
    check_tokenizer,
    heldout_parts,
    open_job_data,
)
from torchtitan_zephon.tracker import LogReader, SequenceTracker, TrackerError, log_path

START_OVER = "--zephon.start_over (TOML: [zephon] start_over = true)"


def _check_loadable(info: runs.CheckpointInfo, job: JobView) -> None:
    """Refuse checkpoints a training job cannot resume from, saying what to do."""
    exclude = set(job.checkpoint.exclude_from_loading)
    step = info.step
    if "dataloader" in exclude:
        raise StartRefused(
            f"the checkpoint {info.path} would restore the trainer at step {step} but no "
            "Zephon data state ('dataloader' is in checkpoint.exclude_from_loading): the data "
            "would restart at step 1. Load the data state too, or start a new --dump_folder."
        )
    if "train_state" in exclude:
        raise StartRefused(
            f"the checkpoint {info.path} would restore the data at step {step + 1} but not the "
            "trainer ('train_state' is in checkpoint.exclude_from_loading): the trainer would "
            "restart at step 1 on later data. Load the train state too, or start a new "
            "--dump_folder."
        )
    if info.holds == "training":
        return
    if info.holds == "model":
        full = [
            c.step
            for c in runs.checkpoints(info.path.parent.parent, info.path.parent.name)
            if c.step < step and c.step > 0 and runs.verify_checkpoint(c).resumable
        ]
        what = (
            f"resume from the last full checkpoint with --checkpoint.load_step {max(full)} "
            f"(step{'s' if step > max(full) + 1 else ''} "
            f"{max(full) + 1}{'..' + str(step) if step > max(full) + 1 else ''} "
            "trained again, on the same data)"
            if full
            else "there is no earlier full checkpoint to resume from: start a new "
            f"--dump_folder with --checkpoint.initial_load_path {info.path} (model only)"
        )
        raise StartRefused(
            f"the checkpoint {info.path} holds only the model (TorchTitan saves the last "
            "step model-only when checkpoint.last_save_model_only = true, its default): no "
            "optimizer, trainer or Zephon data state to resume from. To continue the run, "
            f"{what}; and to make the last checkpoint of a run resumable, set "
            "--checkpoint.no-last_save_model_only (TOML: [checkpoint] last_save_model_only = "
            "false). Nothing was changed on disk."
        )
    raise StartRefused(
        f"the checkpoint {info.path} holds no Zephon data state (no key "
        f"{runs.DATA_STATE_KEY!r}); it was written by another dataloader (stock "
        "TorchTitan?). Start a new --dump_folder, or load only the model with "
        "--checkpoint.initial_load_path and --checkpoint.initial_load_model_only."
    )


def log_mismatch(path: Path, step: int, problem: str) -> str:
    """The refusal of a sequence log that does not hold the checkpoint's chain head."""
    return (
        f"the sequence log {path} does not match the checkpoint of step {step}: "
        f"{problem}. The log belongs to another run or was edited. Restore the run's "
        "own log, or set --zephon.ignore_log_mismatch to continue and restart the "
        "chain from the checkpoint."
    )


def _leftovers(job: JobView) -> list[str]:
    """The history a fresh start would supersede: checkpoints and logged steps."""
    dump = Path(job.dump_folder)
    out = []
    found = [c for c in runs.checkpoints(dump, job.checkpoint.folder) if c.step > 0]
    if found:
        out.append(f"checkpoints {', '.join(f'step-{c.step}' for c in found)}")
    path = log_path(dump)
    if path.is_file():
        first = last = None
        try:
            for record in LogReader(path).records():  # streamed: any log length
                last = int(record["step"])
                first = last if first is None else min(first, last)
        except (TrackerError, KeyError, TypeError, ValueError) as e:
            out.append(f"a sequence log that cannot be read ({e})")
        else:
            if first is not None:
                out.append(f"a sequence log with steps {first}..{last}")
    return out


def _never_checkpointed_same_data(job: JobView, config: DataConfig) -> bool:
    """The run folder holds no whole checkpoint (an interrupted one at most) and every
    start and resume its sequence log records was of ``config``'s data config: what an
    automatic requeue (a scheduler's, or torchrun's restart under a new agent) of a job
    that died before its first checkpoint finds. Anything else is another run's history."""
    if any(c.complete for c in runs.checkpoints(job.dump_folder, job.checkpoint.folder)):
        return False
    path = log_path(job.dump_folder)
    if not path.is_file():
        return True
    try:
        events = LogReader(path).events
    except (TrackerError, OSError):
        return False
    starts = [e for e in events if e.get("event") in ("start", "resume")]
    return bool(starts) and all(
        e.get("data_config_fingerprint") == config.fingerprint for e in starts
    )


BuildTokenizer = Callable[[], Any]
"""Builds the job's tokenizer as TorchTitan will (from hf_assets_path)."""


def _check_job(job: JobView, build_tokenizer: BuildTokenizer | None) -> tuple[JobData, DataConfig]:
    """The job's own settings: the batch layout, the store, the tokenizer. Returns the
    job's data (opened once, here) and its data config."""
    # The data first: raw inputs are prepared (or refused: a missing tokenizer.json
    # said as such) before TorchTitan builds its tokenizer from the same folder.
    data, config = open_job_data(job)
    try:  # a misspelt opt-in is said at every start, not first at the resume it was for
        allowed_fields(job.zephon.allow_changes, config)
    except ValueError as e:
        raise StartRefused(
            f'--zephon.allow_changes: {e} (TOML: [zephon] allow_changes = ["FIELD", ...])'
        ) from None
    tokenizer = None
    if build_tokenizer is not None:
        try:
            tokenizer = build_tokenizer()
        except Exception as e:  # TorchTitan's FileNotFoundError, or the tokenizers
            # library's bare Exception for a file it cannot parse: said as a refusal
            raise StartRefused(tokenizer_refusal(job.hf_assets_path, data, e)) from None
    check_tokenizer(data, tokenizer)
    if job.validation.enable:  # the validator is built after TorchTitan wrote the folder
        heldout_parts(job, data)
    dp = job.dp_degree(int(os.environ.get("WORLD_SIZE", "1")))  # None: TorchTitan says why
    if dp is not None:
        config.batch_schedule().check_layout(dp, job.local_batch_size)
    return data, config


def tokenizer_refusal(path: str, data: Any, error: BaseException) -> str:
    """Why TorchTitan could not load the tokenizer at hf_assets_path ``path``, with
    the tokenizer the data was prepared with (the sha256 of its tokenizer.json, as the
    store records it) and where the builtin tokenizer is (and whether it is that one)."""
    tokenizer_dir, builtin_sha = builtin_tokenizer()
    if not os.path.exists(path):
        found = "does not exist"
    elif not os.path.isdir(path):
        found = "is a file, not a folder"
    else:
        found = f"holds no tokenizer TorchTitan can load ({error})"
    what = data.what
    recorded = data.tokenizer_hash
    if not recorded:
        known = f"{what} does not record its tokenizer's sha256"
    else:
        known = f"{what} was prepared with tokenizer sha256 {recorded}"
    if recorded and recorded == builtin_sha:
        todo = f", the builtin tokenizer in {tokenizer_dir}: set --hf_assets_path {tokenizer_dir}"
    else:
        todo = (
            f"; the builtin tokenizer in {tokenizer_dir} is another one (sha256 "
            f"{builtin_sha}). Point --hf_assets_path at the folder holding the "
            "tokenizer.json the data was prepared with"
        )
    return (
        f"hf_assets_path = {path!r} {found}; TorchTitan builds the job's tokenizer from "
        f"that folder (its tokenizer.json). {known[0].upper()}{known[1:]}{todo} (TOML: "
        "[model] hf_assets_path). Nothing was changed on disk."
    )


def decide_start(
    job: JobView,
    *,
    writer: bool,
    same_job: bool = False,
    build_tokenizer: BuildTokenizer | None = None,
) -> StartDecision:
    """Decide what the job starts from, or raise StartRefused / ValueError. Reads only.

    ``writer``: this is global rank 0, which owns the sequence log (the log and the
    run folder's history are checked there only). ``same_job``: rank 0 took over the
    run folder's lock from an earlier attempt of this very job (a torchrun elastic
    restart), whose history may be superseded. ``build_tokenizer``: the job's
    tokenizer, checked against the data (None: not checked).
    """
    zc = job.zephon
    try:
        data, config = _check_job(job, build_tokenizer)
    except ValueError as e:  # the store, the model, the batch layout: said clearly
        raise StartRefused(str(e)) from None
    chosen, start, why_none = choose_checkpoint(job)
    start.data, start.data_config = data, config
    start.notes.extend(_skips_past_the_end(config, job.steps))
    start.notes.extend(_exclusions_past_the_end(config, job.steps))
    for info in start.skipped:
        what = (
            "incomplete (no .metadata: the job died while writing it)"
            if not info.complete
            else f"corrupt ({info.problem})"
        )
        target = f"step {chosen.step}" if chosen else "scratch"
        start.notes.append(
            f"checkpoint {info.path} is {what} and is skipped; resuming from {target} in "
            f"{info.path.parent}"
        )
    if chosen is not None:
        _check_loadable(chosen, job)
        check_old_run(chosen, start, job)
        try:
            saved = runs.read_data_state(chosen.path)
            decide_resume(saved, config, zc.allow_changes)
        except runs.RunError as e:
            raise StartRefused(str(e)) from None
        except DataStateMismatch as e:
            raise with_trainer_hint(e) from None
        start.resume, start.state = chosen, saved
        head, done = saved.tracker, saved.next_step - 1
        if writer and zc.audit != "off" and head is not None and int(head["step"]) == done:
            path = log_path(job.dump_folder)
            tracker = SequenceTracker(path, config=config, writer=True)
            problem = tracker.cannot_continue(head, repair_index=False)
            if problem is not None and not zc.ignore_log_mismatch:
                raise StartRefused(log_mismatch(path, done, problem))
        return start
    if not writer:
        return start
    leftovers = _leftovers(job)
    if not leftovers:
        return start
    found = " and ".join(leftovers)
    if same_job:
        start.notes.append(
            f"an elastic restart of this job before it could resume ({why_none}): it starts "
            f"again from step 1 in {job.dump_folder}; the log's new start event "
            f"supersedes the steps of the earlier attempt ({found})"
        )
        return start
    if getattr(getattr(job, "fault_tolerance", None), "enable", False):  # its peers heal it
        start.notes.append(
            f"a torchft replica group restarting in its run folder, which holds {found}: "
            "it starts from step 1 and, if its peers are ahead, heals from them at the first "
            "quorum (their weights, data state and the log records it missed)"
        )
        return start
    if zc.start_over:
        start.notes.append(
            f"zephon.start_over: starting from step 1 although the run folder holds {found}; "
            "the log's new start event supersedes those steps"
        )
        return start
    if _never_checkpointed_same_data(job, config):  # a requeue of the same command
        start.notes.append(
            f"this run folder holds {found} but no checkpoint, and its log records this "
            "job's data config: the same job started again after it stopped before its "
            "first checkpoint (a requeue). It starts again from step 1; the log's new start "
            "event supersedes the steps of the earlier attempt"
        )
        return start
    raise StartRefused(
        f"the run folder {job.dump_folder} holds {found}, which this job will not "
        f"resume from ({why_none}), of a run with another data config or with checkpoints. "
        "Starting here would supersede that history. To continue "
        "it, resume from a checkpoint (checkpointing enabled and loading); to keep it, use "
        f"another --dump_folder; to start over in this folder, pass {START_OVER}. "
        "Nothing was changed on disk."
    )


def _skips_past_the_end(config: DataConfig, steps: int) -> list[str]:
    """A warning per ``zephon.skip_steps`` entry that starts after ``training.steps``:
    valid (a later, longer run applies it), but it takes no effect in this run."""
    return [
        f"zephon.skip_steps entry {start}:{count} starts after training.steps ({steps}): "
        f"it takes no effect in this run (a run that trains past step {start - 1} applies it)"
        for start, count in config.skip_steps.entries
        if start > steps
    ]


def _exclusions_past_the_end(config: DataConfig, steps: int) -> list[str]:
    """A warning per ``zephon.exclude`` entry whose from_step is after ``training.steps``:
    valid (a later, longer run applies it), but it leaves nothing out in this run."""
    return [
        f"zephon.exclude entry from step {e['from_step']} ({e['ids']} id"
        f"{'s' * (e['ids'] != 1)}) starts after training.steps ({steps}): it leaves "
        f"nothing out in this run (a run that trains past step {e['from_step'] - 1} applies it)"
        for e in config.exclude
        if int(e["from_step"]) > steps
    ]


def log_start(start: StartDecision) -> None:
    for note in start.notes:
        logger.warning(f"Zephon: {note}")
