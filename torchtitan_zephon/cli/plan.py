"""``zephon plan``: print the ordered sample ids of each step (or of one DP rank)."""

from __future__ import annotations

import argparse
import json

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
        'gets, one JSON object per line: {"step": s, "ids": [...]}.',
    )
    p.add_argument("--store", required=True, metavar="STORE")
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
