"""``zephon plan``: print the ordered sample ids of each step (or of one DP rank).

With ``--mixture FILE`` instead of ``--store``: the ids are per-source sample
ids and ``"sources"`` names the source of each (``sources[i]`` is the source of
``ids[i]``); the plan's warnings and its worst deviation from the exact targets
(``MixturePlan.max_deviation``) go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from torchtitan_zephon.data.plan import BatchSchedule, DataPlan, check_batch_layout
from torchtitan_zephon.data.store import TokenStore


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
    data.add_argument("--store", metavar="STORE")
    data.add_argument(
        "--mixture", metavar="FILE", help="a mixture file (TOML [[source]] / [[schedule]])"
    )
    p.add_argument(
        "--heldout-samples",
        type=int,
        default=0,
        metavar="N",
        help="with --mixture: the job's zephon.heldout_samples (default of each source's)",
    )
    p.add_argument("--seq-len", type=int, required=True, metavar="L")
    p.add_argument(
        "--global-batch-size", required=True, metavar="G", help="'64' or a schedule '1:64,1000:128'"
    )
    p.add_argument("--seed", type=int, required=True, metavar="S")
    p.add_argument("--steps", type=_steps, required=True, metavar="A:B", help="inclusive range")
    p.add_argument("--dp-degree", type=int, default=1, metavar="D")
    p.add_argument("--dp-rank", type=int, default=None, metavar="R")
    p.add_argument("--local-batch-size", type=int, default=None, metavar="B")
    p.add_argument("--sample-offset", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=None)
    p.add_argument("--json", action="store_true", help='one JSON object per line: {"step", "ids"}')
    return p


def run(args: argparse.Namespace) -> int:
    if args.mixture:
        return run_mixture(args)
    store = TokenStore.open(args.store)
    schedule = BatchSchedule.parse(args.global_batch_size)
    available = store.num_samples(args.seq_len)
    num_samples = available - args.sample_offset if args.num_samples is None else args.num_samples
    if args.sample_offset < 0 or num_samples < 1 or args.sample_offset + num_samples > available:
        raise ValueError(
            f"samples [{args.sample_offset}, {args.sample_offset + num_samples}) do not fit the "
            f"store, which holds {available} samples of seq_len {args.seq_len}."
        )
    if args.dp_rank is not None and not 0 <= args.dp_rank < args.dp_degree:
        raise ValueError(f"--dp-rank must be in [0, {args.dp_degree}), got {args.dp_rank}.")
    for _, gbs in schedule.entries:
        check_batch_layout(gbs, args.dp_degree, args.local_batch_size or 1)
    plan = DataPlan(num_samples, args.seed, schedule, args.sample_offset)
    first, last = args.steps
    for step in range(first, last + 1):
        if args.dp_rank is None:
            ids = plan.global_ids(step)
        else:
            ids = plan.rank_ids(step, args.dp_rank, args.dp_degree)
        if args.json:
            print(json.dumps({"step": step, "ids": ids.tolist()}, separators=(",", ":")))
        else:
            print(f"step {step}: " + " ".join(map(str, ids.tolist())))
    return 0


def run_mixture(args: argparse.Namespace) -> int:
    """``zephon plan --mixture FILE``: the steps' (source, sample id) pairs."""
    from torchtitan_zephon.data.mixture import MixtureConfig
    from torchtitan_zephon.data.source import MixtureSource, MixtureStream

    schedule = BatchSchedule.parse(args.global_batch_size)
    if args.dp_rank is not None and not 0 <= args.dp_rank < args.dp_degree:
        raise ValueError(f"--dp-rank must be in [0, {args.dp_degree}), got {args.dp_rank}.")
    for _, gbs in schedule.entries:
        check_batch_layout(gbs, args.dp_degree, args.local_batch_size or 1)
    if args.heldout_samples < 0:
        raise ValueError(f"--heldout-samples must be >= 0, got {args.heldout_samples}.")
    source = MixtureSource.open(
        MixtureConfig.load(args.mixture),
        args.seq_len,
        default_heldout=args.heldout_samples,
        path=args.mixture,
    )
    plan = source.plan(source.data_config(seed=args.seed, schedule=schedule))
    assert isinstance(plan, MixtureStream)
    first, last = args.steps
    plan.mixture.check_max_epochs(last)
    for warning in source.warnings:
        print(f"zephon plan: warning: {warning}", file=sys.stderr)
    worst, who = plan.mixture.max_deviation()
    print(
        f"zephon plan: mixture of {len(plan.names)} sources ({', '.join(plan.names)}); every "
        f"source's count stays within {float(worst):.4g} samples ({worst.numerator}/"
        f"{worst.denominator}) of its exact target at every step (worst: {who!r}).",
        file=sys.stderr,
    )
    for step in range(first, last + 1):
        if args.dp_rank is None:
            keys = plan.global_ids(step)
        else:
            keys = plan.rank_ids(step, args.dp_rank, args.dp_degree)
        names, ids = plan.decode(keys)
        if args.json:
            line = {"step": step, "ids": ids.tolist(), "sources": names}
            print(json.dumps(line, separators=(",", ":")))
        else:
            pairs = " ".join(f"{n}:{i}" for n, i in zip(names, ids.tolist(), strict=True))
            print(f"step {step}: {pairs}")
    return 0
