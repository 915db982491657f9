"""``zephon plan``: print the ordered sample ids of each step (or of one DP rank).

Invariant: the ids printed for a step are ``DataPlan.global_ids`` (or
``rank_ids``) of that step, the ones the trainer's loader reads (with
``--skip-steps``, the trainer's ``zephon.skip_steps``, and ``--exclude FILE``, the
trainer's ``zephon.exclude``: each entry is also said on stderr; ``load_exclude``
and ``leave_out`` read that flag for ``show``, ``where`` and ``spikes`` too). They are
computed and printed ``BLOCK`` ids at a time, so memory stays bounded whatever
the batch size; a step with more than ``MAX_IDS_PER_STEP`` ids is refused
before anything is printed. Bad arguments are refused before the store is read.

With ``--mixture FILE`` instead of ``--store``: the ids are per-source sample
ids and ``"sources"`` names the source of each (``sources[i]`` is the source of
``ids[i]``); the plan's warnings and its worst deviation from the exact targets
(``MixturePlan.max_deviation``) go to stderr.

A store value (``--store``, a mixture source) is read as the trainer reads it
(``job.stores.store_location``): a store folder, ``builtin:PART``, or raw inputs, which
``--tokenizer`` (the trainer's ``hf_assets_path``; TOML: ``model.hf_assets_path``) and ``--text-field``
prepare into the same cache entry the trainer would use, so the ids are the
trainer's. A store smaller than a global batch is a warning; one with fewer than
``MIN_STORE_SAMPLES`` training samples is refused, as the trainer refuses it.

With ``--packing best_fit`` the samples are the packed samples of the store's packing
index (``order.packing``, built once per store and seq_len by ``job.packing``): the
ids printed are packed sample ids, ordered by the same keyed permutation per epoch.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from torchtitan_zephon.cli.args import int_in, schedule_arg, skip_steps_arg
from torchtitan_zephon.ingest.cache import RawInputs, names_store
from torchtitan_zephon.job.packing import open_packing, packing_note
from torchtitan_zephon.job.stores import RAW_HINT, open_named_store
from torchtitan_zephon.order.data_config import SKIP_FIELD
from torchtitan_zephon.order.exclusions import Exclusions
from torchtitan_zephon.order.layout import BatchSchedule
from torchtitan_zephon.order.packing import PACKING_METHODS
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.order.store_size import (
    MIN_STORE_SAMPLES,
    check_store_size,
    no_sample_text,
    store_fix,
)
from torchtitan_zephon.order.stream import DataPlan
from torchtitan_zephon.store.reader import TokenStore

if TYPE_CHECKING:
    from torchtitan_zephon.job.data import JobData

BLOCK = 1 << 20  # ids computed and written at a time
MAX_IDS_PER_STEP = 10**9  # about 10 GB of output for one step


def _steps(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected FIRST:LAST (inclusive, 1-based) like 1:10, got {text!r}"
        ) from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= FIRST <= LAST, got {text!r}")
    return a, b


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="print the sample ids of each step",
        description="Print, per step, the ordered sample ids the whole step (or one DP rank) "
        'gets, one JSON object per line: {"step": s, "ids": [...]}. With --mixture: '
        '{"step": s, "ids": [...], "sources": [...]} (ids are per-source sample ids).',
    )
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument(
        "--store",
        metavar="STORE",
        help="a token store, builtin:PART, or raw inputs (with --tokenizer), as zephon.store",
    )
    data.add_argument(
        "--mixture", metavar="FILE", help="a mixture file (TOML [[source]] / [[schedule]])"
    )
    raw = p.add_argument_group(
        "raw inputs",
        "where --store or a mixture source names raw inputs (files, folders, globs), they are "
        "prepared into the store cache as the trainer prepares them",
    )
    raw.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="folder holding the tokenizer.json (the trainer's hf_assets_path; TOML: model.hf_assets_path)",
    )
    raw.add_argument(
        "--text-field",
        default="text",
        metavar="F",
        help="JSON / Parquet field of the text (the trainer's zephon.text_field; default: text)",
    )
    raw.add_argument(
        "--split",
        default="",
        metavar="NAME",
        help="the split of a Hugging Face DatasetDict to read (the trainer's zephon.split; "
        "default: train; 'all': every split)",
    )
    raw.add_argument(
        "--cache-dir",
        default="",
        metavar="DIR",
        help="the store cache when ZEPHON_CACHE is unset (the trainer's zephon.cache_dir)",
    )
    raw.add_argument(
        "--workers", type=int_in(1), default=1, metavar="N", help="tokenizer processes"
    )
    p.add_argument(
        "--heldout-samples",
        type=int_in(0),
        default=0,
        metavar="N",
        help="the job's zephon.heldout_samples: a store's last N samples are held out "
        "(validation), as the trainer holds them out (default 0, the trainer's default); "
        "with --mixture: the default of each source's",
    )
    p.add_argument("--seq-len", type=int_in(1), required=True, metavar="L")
    p.add_argument(
        "--packing",
        choices=PACKING_METHODS,
        default="none",
        help="the trainer's zephon.packing: none (fixed windows, the default) or best_fit "
        "(whole documents; the ids are packed sample ids of the store's packing index)",
    )
    p.add_argument(
        "--global-batch-size",
        type=schedule_arg,
        required=True,
        metavar="G",
        help="'64' or a schedule '1:64,1000:128'",
    )
    p.add_argument("--seed", type=int, required=True, metavar="S")
    p.add_argument(
        "--skip-steps",
        type=skip_steps_arg,
        default=SkipSteps(),
        metavar="S:N,...",
        help="the trainer's zephon.skip_steps: at step S, skip the data of N steps",
    )
    add_exclude_argument(p)
    p.add_argument("--steps", type=_steps, required=True, metavar="A:B", help="inclusive range")
    p.add_argument("--dp-degree", type=int_in(1), default=1, metavar="D")
    p.add_argument("--dp-rank", type=int_in(0), default=None, metavar="R")
    p.add_argument("--local-batch-size", type=int_in(1), default=None, metavar="B")
    p.add_argument("--sample-offset", type=int_in(0), default=0)
    p.add_argument("--num-samples", type=int_in(1), default=None)
    p.add_argument("--json", action="store_true", help='one JSON object per line: {"step", "ids"}')
    return p


def add_exclude_argument(p: argparse.ArgumentParser, extra: str = "") -> None:
    """``--exclude FILE``, the trainer's ``zephon.exclude`` (``zephon plan``, ``show``,
    ``where``, ``spikes``: read by ``load_exclude``)."""
    p.add_argument(
        "--exclude",
        default="",
        metavar="FILE",
        help="the trainer's zephon.exclude: a JSON-lines list of sample ids left out from "
        'a step on ({"source": NAME, "ids": [...], "from_step": S}; "source" only with '
        f"a mixture){extra}",
    )


def load_exclude(path: str | None, setting: str = "--exclude") -> Exclusions | None:
    """The left-out list of ``path`` (None without one): ValueError, one line naming the
    file's line, when it cannot be read or parsed."""
    return Exclusions.load(path, setting) if path else None


def leave_out(data: JobData, path: str | None) -> Exclusions | None:
    """``--exclude FILE`` loaded and checked against ``data`` (``JobData.leave_out``),
    which then binds it in every data config and plan it makes."""
    exclusions = load_exclude(path)
    if exclusions is not None:
        data.leave_out(exclusions)
    return exclusions


def _largest_step(schedule: BatchSchedule, first: int, last: int) -> tuple[int, int]:
    """(step, global batch size) of the largest batch among steps first..last."""
    best = (first, schedule.gbs(first))
    for start, gbs in schedule.entries:
        if first < start <= last and gbs > best[1]:
            best = (start, gbs)
    return best


def run(args: argparse.Namespace) -> int:
    schedule: BatchSchedule = args.global_batch_size
    first, last = args.steps
    if args.dp_rank is not None and args.dp_rank >= args.dp_degree:
        raise ValueError(
            f"--dp-rank {args.dp_rank} must be below --dp-degree {args.dp_degree} "
            f"(ranks are 0 .. {args.dp_degree - 1})."
        )
    step, gbs = _largest_step(schedule, first, last)
    per_step = gbs if args.dp_rank is None else gbs // args.dp_degree
    if per_step > MAX_IDS_PER_STEP:
        raise ValueError(
            f"step {step} has {per_step} sample ids to print; zephon plan prints at most "
            f"{MAX_IDS_PER_STEP} per step. Check --global-batch-size, or print one DP rank's "
            "slice with --dp-degree D --dp-rank R."
        )
    schedule.check_layout(args.dp_degree, args.local_batch_size or 1)
    raw = given_raw_inputs(args)
    if args.mixture:
        return run_mixture(args, schedule, raw)
    store = open_named_store(args.store, raw)
    available = store.num_samples(args.seq_len)
    packed = None
    if args.packing != "none":
        packed, index = open_packing(
            store, args.seq_len, cache_dir=args.cache_dir, workers=args.workers
        )
        print(f"zephon plan: {packing_note(packed, store, index)}", file=sys.stderr)
        available = packed.num_samples
    what = store_name(args.store, store)
    wanted = args.sample_offset + max(args.num_samples or 0, MIN_STORE_SAMPLES)
    fix = store_fix(store.num_tokens, wanted, "--seq-len")
    if available == 0:
        raise ValueError(f"{no_sample_text(what, store.num_tokens, args.seq_len)}. {fix}")
    if args.heldout_samples and args.num_samples is not None:
        raise ValueError(
            f"--heldout-samples {args.heldout_samples} and --num-samples {args.num_samples} "
            "both set how many samples train: give one (--heldout-samples holds out the "
            "store's last N samples, as zephon.heldout_samples does)."
        )
    held = args.heldout_samples
    if args.num_samples is None:
        num_samples = available - args.sample_offset - held
    else:
        num_samples = args.num_samples
    if held and num_samples < 1:
        raise ValueError(
            f"--heldout-samples {held} leaves no training sample: {what} holds {available} "
            f"samples of seq_len {args.seq_len}; hold out fewer than "
            f"{available - args.sample_offset}."
        )
    if num_samples < 1 or args.sample_offset + num_samples > available:
        raise ValueError(
            f"samples [{args.sample_offset}, {args.sample_offset + num_samples}) do not fit the "
            f"store {store.path}, which holds {available} samples of seq_len {args.seq_len} "
            f"({store.num_tokens} tokens). {fix}"
        )
    if args.num_samples is not None:
        fix = f"To change it: raise --num-samples (now {args.num_samples})."
    warning = check_store_size(f"{what} (seq_len {args.seq_len})", num_samples, schedule, fix)
    if warning:
        print(f"zephon plan: warning: {warning}", file=sys.stderr)
    exclusions = None
    if args.exclude:  # ids of the samples planned (packed ones with --packing)
        from torchtitan_zephon.job.data import JobData

        data = JobData.of_store(
            store, args.seq_len, packed=packed, sample_offset=args.sample_offset,
            num_samples=num_samples,
        )  # fmt: skip
        exclusions = leave_out(data, args.exclude)
    plan = DataPlan(
        num_samples,
        args.seed,
        schedule,
        args.sample_offset,
        skips=args.skip_steps,
        exclusions=exclusions.for_source(None) if exclusions else (),
    )
    _say_skips(args.skip_steps, last, schedule)
    _say_exclusions(exclusions, last)
    out = sys.stdout
    for step in range(first, last + 1):
        if args.dp_rank is None:
            position, count = plan.step_positions(step)
        else:
            position, count = plan.rank_positions(step, args.dp_rank, args.dp_degree)
        out.write(f'{{"step":{step},"ids":[' if args.json else f"step {step}: ")
        sep = "," if args.json else " "
        for done in range(0, count, BLOCK):
            ids = plan.ids_for_positions(position + done, min(BLOCK, count - done))
            out.write((sep if done else "") + sep.join(map(str, ids.tolist())))
        out.write("]}\n" if args.json else "\n")
    return 0


def _say_skips(skips: SkipSteps, last: int, schedule: BatchSchedule) -> None:
    """One stderr line per skip entry: what it skips (the ids printed are past it)."""
    for (start, _), text in zip(skips.entries, skips.describe(schedule.gbs), strict=True):
        later = f" (after the last step printed, {last})" if start > last else ""
        print(f"zephon plan: skip_steps {text}{later}.", file=sys.stderr)


def _say_exclusions(exclusions: Exclusions | None, last: int) -> None:
    """One stderr line per left-out entry (the ids printed are past them)."""
    if not exclusions:
        return
    for entry, text in zip(exclusions.entries, exclusions.describe(), strict=True):
        later = f" (after the last step printed, {last})" if entry.from_step > last else ""
        print(f"zephon plan: exclude {text}{later}.", file=sys.stderr)


def given_raw_inputs(args: argparse.Namespace, command: str = "plan") -> RawInputs | None:
    """How raw inputs are prepared (None without --tokenizer): as the trainer does it;
    ``command`` names the ``zephon`` subcommand in what it logs."""
    if args.tokenizer is None:
        return None
    return RawInputs(
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        split=args.split,
        cache_dir=args.cache_dir,
        workers=args.workers,
        progress=sys.stderr.isatty(),
        log=lambda message: print(f"zephon {command}: {message}", file=sys.stderr),
        tokenizer_origin="--tokenizer",
    )


def store_name(value: str, store: TokenStore) -> str:
    """The store as the user named it, and where it is when that differs (a builtin
    part, raw inputs prepared into the cache)."""
    if str(store.path) == value:
        return f"the store {value}"
    return f"the store {value!r} ({store.path})"


def run_mixture(
    args: argparse.Namespace, schedule: BatchSchedule, raw: RawInputs | None = None
) -> int:
    """``zephon plan --mixture FILE``: the steps' per-source sample ids and their sources."""
    from torchtitan_zephon.job.data import JobData
    from torchtitan_zephon.order.mixture.config import MixtureConfig, MixtureError
    from torchtitan_zephon.order.mixture.plan import deviation_warning

    config = MixtureConfig.load(args.mixture)
    for s in config.sources:
        if raw is None and not names_store(s.store):
            raise MixtureError(
                f"mixture source {s.name!r} names raw inputs ({s.store}): {RAW_HINT}."
            )
    say = lambda line: print(f"zephon plan: {line}", file=sys.stderr)  # noqa: E731
    source = JobData.open_mixture(  # with packing, each source packs its own documents
        config,
        args.seq_len,
        packing=args.packing,
        default_heldout=args.heldout_samples,
        path=args.mixture,
        raw=raw,
        cache_dir=args.cache_dir,
        workers=args.workers,
        log=say,
        warn=lambda line: say(f"warning: {line}"),
    )
    exclusions = leave_out(source, args.exclude)
    extra = {SKIP_FIELD: args.skip_steps.to_json()} if args.skip_steps else {}
    plan = source.plan(source.data_config(seed=args.seed, schedule=schedule, extra=extra))
    first, last = args.steps
    _say_skips(args.skip_steps, last, schedule)
    _say_exclusions(exclusions, last)
    plan.check_max_epochs(last)
    for warning in source.warnings:
        print(f"zephon plan: warning: {warning}", file=sys.stderr)
    worst, who, step = plan.mixture.deviation_report()
    warning = deviation_warning(worst, who, step)
    if warning:
        print(f"zephon plan: warning: {warning}", file=sys.stderr)
    print(
        f"zephon plan: mixture of {len(plan.names)} sources ({', '.join(plan.names)}); every "
        f"source's count stays within {float(worst):.4g} samples ({worst.numerator}/"
        f"{worst.denominator}) of its exact target at every step (worst: {who!r}).",
        file=sys.stderr,
    )
    out = sys.stdout
    sep = "," if args.json else " "
    for step in range(first, last + 1):
        if args.dp_rank is None:
            position, count = plan.step_positions(step)
        else:
            position, count = plan.rank_positions(step, args.dp_rank, args.dp_degree)
        blocks = [(position + done, min(BLOCK, count - done)) for done in range(0, count, BLOCK)]
        if args.json:  # ids, then their sources: each block computed twice, memory bounded
            out.write(f'{{"step":{step},"ids":[')
            for k, block in enumerate(blocks):
                _, ids = plan.decode(plan.ids_for_positions(*block))
                out.write((sep if k else "") + sep.join(map(str, ids.tolist())))
            out.write('],"sources":[')
            for k, block in enumerate(blocks):
                names, _ = plan.decode(plan.ids_for_positions(*block))
                out.write((sep if k else "") + sep.join(json.dumps(n) for n in names))
            out.write("]}\n")
        else:
            out.write(f"step {step}: ")
            for k, block in enumerate(blocks):
                names, ids = plan.decode(plan.ids_for_positions(*block))
                pairs = (f"{n}:{i}" for n, i in zip(names, ids.tolist(), strict=True))
                out.write((sep if k else "") + sep.join(pairs))
            out.write("\n")
    return 0
