"""The data flags of ``zephon show``, ``where`` and ``spikes`` (``add_data_arguments``),
read into the data a step reads (``job.step_data``): a run folder through
``job.step_data.open_run`` (the run's data config and stores, found from what it
recorded; the flags say where its data is when that does not), a store or a mixture
with ``--seq-len``, ``--global-batch-size`` and ``--seed`` opened as the trainer opens
them (``job.data.JobData``) and handed to ``job.step_data.of_job_data``; and
``ShowError``, bad input to these commands.

Invariant: reading only; bad flags are a ``ShowError`` (one line, ``cli.main``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_zephon.cli.args import int_in, schedule_arg, skip_steps_arg
from torchtitan_zephon.cli.inspect_run import is_run
from torchtitan_zephon.cli.plan import add_exclude_argument, given_raw_inputs, leave_out
from torchtitan_zephon.job.step_data import StepData, of_job_data, open_run
from torchtitan_zephon.job.stores import open_named_store
from torchtitan_zephon.order.data_config import SKIP_FIELD
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.skips import SkipSteps


class ShowError(ValueError):
    """Bad input to show / where / spikes (reported by ``cli.main`` in one line)."""


def say_notes(data: StepData, command: str) -> None:
    for note in data.notes:
        print(f"zephon {command}: note: {note}", file=sys.stderr)


def add_data_arguments(p: argparse.ArgumentParser, *, target: str = "TARGET") -> None:
    """The flags that name the data: a run folder or a store (positional), or a mixture."""
    p.add_argument(
        "target",
        nargs="?",
        metavar=target,
        help="a run folder (TorchTitan dump folder: its data config, skips included, comes "
        "from its sequence log) or a token store (then --seq-len, --global-batch-size, --seed)",
    )
    p.add_argument(
        "--store",
        metavar="STORE",
        help="with a run: where its store is when the saved job config does not say "
        "(checked against the run's store fingerprint)",
    )
    p.add_argument(
        "--mixture",
        metavar="FILE",
        help="a mixture file (TOML [[source]] / [[schedule]]): instead of a store, or with a run "
        "whose saved config does not name it",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="folder holding the tokenizer.json to decode with (default: the run's "
        "hf_assets_path, else the builtin tokenizer, when it is the store's)",
    )
    p.add_argument("--seq-len", type=int_in(1), default=None, metavar="L")
    p.add_argument(
        "--global-batch-size", type=schedule_arg, default=None, metavar="G",
        help="'64' or a schedule '1:64,1000:128'",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument(
        "--skip-steps", type=skip_steps_arg, default=SkipSteps(), metavar="S:N,...",
        help="with a store or mixture: the trainer's zephon.skip_steps",
    )  # fmt: skip
    p.add_argument(
        "--heldout-samples", type=int_in(0), default=0, metavar="N",
        help="with a store or mixture: the job's zephon.heldout_samples (default 0)",
    )  # fmt: skip
    add_exclude_argument(
        p, "; with a run: the list it was trained with, when its saved job config does not "
        "name it (checked against the sha256 its data config binds)",
    )  # fmt: skip


def open_step_data(args: argparse.Namespace, command: str) -> StepData:
    """The data ``args`` name (a run, a store or a mixture), opened once."""
    args.text_field, args.split, args.cache_dir, args.workers = "text", "", "", 1
    target = args.target
    if target is not None and is_run(Path(target)):
        given = [
            f for f in ("seq_len", "global_batch_size", "seed") if getattr(args, f) is not None
        ]
        if given or args.skip_steps:
            flags = ", ".join(
                "--" + f.replace("_", "-") for f in given + ["skip_steps"] * bool(args.skip_steps)
            )
            raise ShowError(
                f"{target} is a run folder: its sequence log's data config decides the data "
                f"(seq_len, batch schedule, seed, skip_steps); drop {flags}."
            )
        return open_run(
            Path(target),
            store=args.store,
            mixture=args.mixture,
            tokenizer=args.tokenizer,
            exclude=args.exclude,
        )
    if target is None and not args.mixture:
        raise ShowError(
            f"zephon {command} needs a run folder or a store (positional), or --mixture FILE."
        )
    if (
        target is not None
        and not Path(target).exists()
        and not target.startswith(("builtin:", "s3://", "gs://", "az://"))
    ):
        raise ShowError(
            f"{target} does not exist: expected a run folder (TorchTitan dump folder) or a token store."
        )
    missing = [f for f in ("seq_len", "global_batch_size", "seed") if getattr(args, f) is None]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        what = "a store" if target is not None else "a mixture"
        raise ShowError(
            f"with {what} (not a run folder) zephon {command} needs {flags}: the job's "
            "training.seq_len, training.global_batch_size and zephon.seed."
        )
    if target is not None and args.mixture:
        raise ShowError("give a store or --mixture FILE, not both.")
    return _open_given(args, command)


def _open_given(args: argparse.Namespace, command: str) -> StepData:
    from torchtitan_zephon.job.data import JobData
    from torchtitan_zephon.job.settings import store_data
    from torchtitan_zephon.order.mixture.config import MixtureConfig

    schedule: BatchSchedule = args.global_batch_size
    extra = {SKIP_FIELD: args.skip_steps.to_json()} if args.skip_steps else {}
    raw = given_raw_inputs(args, command)
    if args.mixture:
        data = JobData.open_mixture(
            MixtureConfig.load(args.mixture),
            args.seq_len,
            default_heldout=args.heldout_samples,
            path=args.mixture,
            raw=raw,
        )
        what = f"the mixture {args.mixture}"
    else:
        store = open_named_store(args.target, raw)
        what = f"the store {args.target}"
        data = store_data(store, args.seq_len, args.heldout_samples, schedule, what=what)
    leave_out(data, args.exclude)
    config = data.data_config(seed=args.seed, schedule=schedule, extra=extra)
    return of_job_data(data, config, what, args.tokenizer)
