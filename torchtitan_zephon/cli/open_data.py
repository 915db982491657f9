"""Opening the data a step reads (``StepData``) for ``zephon show``, ``where`` and
``spikes``: from a run folder (its sequence log's newest start or resume event holds
the data config, skips included, and a trained step is described under the data config
of the job that trained it: ``cli.run_history``; its stores and tokenizer are found from what the run
recorded, ``job.run_data``, the job config it saved, the command line or the builtin
data, each checked against the config's fingerprints; its left-out list from
``--exclude FILE``, the record or the saved job config, checked against the sha256 the
config binds), or from a store or a mixture file with ``--seq-len``,
``--global-batch-size`` and ``--seed`` (``add_data_arguments``).

Invariant: reading only; a run's left-out list not found or not the one its data
config binds, a run without a data config, bad flags, are a ``ShowError`` (one line).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

from torchtitan_zephon.cli.args import int_in, schedule_arg, skip_steps_arg
from torchtitan_zephon.cli.inspect_run import is_run
from torchtitan_zephon.cli.plan import (
    add_exclude_argument,
    given_raw_inputs,
    leave_out,
    load_exclude,
    open_named_store,
)
from torchtitan_zephon.cli.run_history import RunHistory, TrainedUnder
from torchtitan_zephon.cli.step_data import ShowError, StepData
from torchtitan_zephon.job.plans import exclusions_problem, plan_of
from torchtitan_zephon.job.run_data import read_run_data, recorded
from torchtitan_zephon.order.data_config import SKIP_FIELD, DataConfig
from torchtitan_zephon.order.exclusions import Exclusions
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.stream import StreamPlan
from torchtitan_zephon.run import recorded as runs
from torchtitan_zephon.store.reader import TokenStore


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
        return _open_run(Path(target), args)
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
        leave_out(data, args.exclude)
        config = data.data_config(seed=args.seed, schedule=schedule, extra=extra)
        plan: StreamPlan = data.plan(config)
        stores: list[TokenStore | None] = list(data.stores)
        what = f"the mixture {args.mixture}"
        names = list(data.names)
    else:
        store = open_named_store(args.target, raw)
        what = f"the store {args.target}"
        one = store_data(store, args.seq_len, args.heldout_samples, schedule, what=what)
        leave_out(one, args.exclude)
        config = one.data_config(seed=args.seed, schedule=schedule, extra=extra)
        plan = one.plan(config)
        stores, names = [store], [""]
    tokenizer, note = _tokenizer(config.tokenizer_hash, [args.tokenizer])
    data = StepData(what, plan, config, names, stores, tokenizer, args.seq_len)
    if note:
        data.notes.append(note)
    return data


def _open_run(run: Path, args: argparse.Namespace) -> StepData:
    """The run's data under its newest job's data config; a trained step is described
    under the data config of the job that trained it (``StepData.as_trained``)."""
    history = RunHistory(run)
    opened: dict[Any, StepData] = {}

    def open_job(job: TrainedUnder) -> StepData:
        if job.key not in opened:
            try:
                opened[job.key] = _open_job(run, args, history, job)
            except ShowError as e:
                if job is history.newest:
                    raise
                raise ShowError(
                    f"the steps after {job.event.get('from_step')} up to the next start or "
                    f"resume of the run {run} were trained under an earlier data config "
                    f"(fingerprint {job.config.fingerprint[:12]}), which cannot be opened "
                    f"here: {e}"
                ) from None
        return opened[job.key]

    data = open_job(history.newest)
    data.open_job = open_job
    return data


def _open_job(
    run: Path, args: argparse.Namespace, history: RunHistory, job: TrainedUnder
) -> StepData:
    config = job.config
    saved = runs.saved_config(run)
    saved_job = saved[1] if saved else {}
    zephon = saved_job.get("zephon") if isinstance(saved_job.get("zephon"), dict) else {}
    record = read_run_data(run)  # what Zephon recorded at the run's newest start
    exclude = recorded(record, "exclude") or zephon.get("exclude")
    exclusions = _run_exclusions(run, config, args.exclude, exclude)
    plan = plan_of(config, job.anchor, exclusions=exclusions)
    notes: list[str] = []
    if config.mixture is None:
        names = [""]
        given = [
            args.store,
            recorded(record, "store", "opened"),
            recorded(record, "store", "given"),
        ]
        stores = [_run_store(config, [*given, zephon.get("store")], notes)]
    else:
        names = list(plan.names)
        mixtures = [args.mixture, recorded(record, "mixture", "given"), zephon.get("mixture")]
        sources = record["mixture"].get("sources") if recorded(record, "mixture", "given") else {}
        stores = _run_mixture_stores(config, mixtures, notes, sources)
    assets = saved_job.get("hf_assets_path")
    if assets is None and isinstance(saved_job.get("model"), dict):
        assets = saved_job["model"].get("hf_assets_path")
    folders = [args.tokenizer, recorded(record, "tokenizer"), assets]
    tokenizer, note = _tokenizer(config.tokenizer_hash, folders)
    if note:
        notes.append(note)
    packed = _run_packed(config, stores) if config.packing != "none" else None
    return StepData(
        f"the run {run}",
        plan,
        config,
        names,
        stores,
        tokenizer,
        config.seq_len,
        dp_degree=history.newest.dp_degree or 1,
        trained_last=history.trained_last,
        notes=notes,
        trained_degree=lambda step: history.job_of(step).dp_degree,
        packed=packed,
        history=history,
        job=job,
    )


def _run_packed(config: DataConfig, stores: list[TokenStore | None]) -> list[Any]:
    """A packing run's stores (one per source) as packed samples (None: not found)."""
    from torchtitan_zephon.job.data import source_of
    from torchtitan_zephon.job.packing import open_packing

    return [
        None if st is None else source_of(st, config.seq_len, open_packing(st, config.seq_len)[0])
        for st in stores
    ]


def _run_exclusions(
    run: Path, config: DataConfig, given: str | None, saved: Any
) -> Exclusions | None:
    """The left-out list the run's data config binds (only its entries' sha256): from
    ``--exclude FILE``, else the saved job config's zephon.exclude (read only when the
    config leaves samples out); ShowError, one line, when it is not that list."""
    what = f"the run {run}'s data config"
    if given:
        exclusions = load_exclude(given)
    elif config.exclude and isinstance(saved, str) and saved:
        if not Path(saved).is_file():
            raise ShowError(
                f"{exclusions_problem(config, None, what)}; its saved job config names "
                f"zephon.exclude {saved}, which is not a file here: pass --exclude FILE, the "
                "zephon.exclude list the run was trained with."
            )
        exclusions = load_exclude(saved, "the run's saved zephon.exclude")
    else:
        exclusions = None
    problem = exclusions_problem(config, exclusions, what)
    if problem is None:
        return exclusions
    if not config.exclude:
        raise ShowError(f"{problem}: drop --exclude.")
    where = "" if exclusions else " (its saved job config names no zephon.exclude)"
    raise ShowError(
        f"{problem}{where}: pass --exclude FILE, the zephon.exclude list the run was trained with."
    )


def _run_store(config: DataConfig, candidates: list[Any], notes: list[str]) -> TokenStore | None:
    """The run's store: the first of the candidates (a --store, the store the run
    recorded, opened then as given, the saved zephon.store, then the builtin store)
    whose fingerprint is the run's."""
    from torchtitan_zephon.ingest.builtin import builtin_store_path

    tried = []
    for value in [c for c in candidates if isinstance(c, str) and c] + [None]:
        try:
            store = (
                TokenStore.open(builtin_store_path(progress=False))
                if value is None
                else open_named_store(value, None)
            )
        except (ValueError, OSError) as e:
            tried.append(f"{value or 'the builtin store'} ({e})")
            continue
        if store.fingerprint == config.store_fingerprint:
            return store
        tried.append(f"{store.path} (fingerprint {store.fingerprint[:12]})")
    notes.append(
        f"the run's store (fingerprint {config.store_fingerprint[:12]}) was not found "
        f"(tried {'; '.join(tried)}): documents and text are left out; pass --store STORE."
    )
    return None


def _run_mixture_stores(
    config: DataConfig, candidates: list[Any], notes: list[str], opened: Any = None
) -> list[TokenStore | None]:
    """Each source's store of a run's mixture, from a mixture file (--mixture, the
    recorded or saved zephon.mixture) whose source of that name has the run's
    fingerprint, else from the store the run opened for it (``opened``: name ->
    location, ``zephon/run_data.json``)."""
    from torchtitan_zephon.job.stores import open_mixture_stores
    from torchtitan_zephon.order.mixture.config import MixtureConfig

    spec = config.mixture or {}
    wanted = {s["name"]: s["store_fingerprint"] for s in spec.get("sources", [])}
    names = sorted(wanted)
    found: dict[str, TokenStore] = {}
    for value in [c for c in candidates if isinstance(c, str) and c]:
        try:
            stores = open_mixture_stores(MixtureConfig.load(value))
        except (ValueError, OSError) as e:
            notes.append(f"cannot open the mixture {value}: {e}")
            continue
        for name, store in stores.items():
            if name not in found and wanted.get(name) == store.fingerprint:
                found[name] = store
    for name in [n for n in names if n not in found]:
        location = opened.get(name) if isinstance(opened, dict) else None
        if isinstance(location, str) and location:
            try:
                store = open_named_store(location, None)
            except (ValueError, OSError):
                continue
            if store.fingerprint == wanted[name]:
                found[name] = store
    lost = [n for n in names if n not in found]
    if lost:
        notes.append(
            f"the stores of mixture sources {', '.join(repr(n) for n in lost)} were not found "
            "with the run's fingerprints: their documents and text are left out; pass "
            "--mixture FILE."
        )
    return [found.get(n) for n in names]


def _tokenizer(sha256: str, candidates: list[Any]) -> tuple[Any, str | None]:
    """The first candidate folder (then the builtin tokenizer) whose tokenizer.json is the
    store's (sha256), loaded; else (None, a note)."""
    from tokenizers import Tokenizer

    from torchtitan_zephon.job.settings import builtin_tokenizer

    folders = [Path(c) for c in candidates if isinstance(c, str) and c]
    folders.append(builtin_tokenizer()[0])
    for folder in folders:
        path = folder / "tokenizer.json" if folder.is_dir() else folder
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha256(data).hexdigest() == sha256:
            return Tokenizer.from_str(data.decode()), None
    return None, (
        f"no tokenizer.json with the store's sha256 {sha256[:12]} found (tried "
        f"{', '.join(str(f) for f in folders)}): text is left out; pass --tokenizer DIR."
    )
