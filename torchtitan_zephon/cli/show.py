"""``zephon show``: what a step trains on, sample by sample (past or future steps).

Role: opens the data a step reads (``StepData``: a plan, the stores it names, the
tokenizer) from a run folder (its sequence log's newest start or resume event
holds the data config, skips included; its stores and tokenizer are found from what
the run recorded (``job.run_data``), the job config it saved, the command line or the
builtin data, each checked against the config's fingerprints; its left-out list,
``zephon.exclude``, from ``--exclude FILE``, the record or the saved job config,
checked against the sha256 the config binds), or from a store or a mixture file with
``--seq-len``, ``--global-batch-size`` and ``--seed``. Words: a step's **slots** are
its place in the batch schedule (``[first, first + GBS)``, the sequence log's
``first_position``; skips and left-out samples never move them); a sample's
**position** is its index in its source's stream (past the skips and the left-out
samples: epoch = position // the source's samples), as ``where`` says
``stream_position``. For each sample of the step (or of one DP
rank's slice, or one sample) it prints its source, sample id, position, the documents its
``seq_len`` input tokens belong to (id, the window's offsets within the document,
the document's length) and the decoded text. ``zephon where`` and ``zephon
spikes`` open their data here too.

Invariants:
- The sample ids shown for a step are the plan's (``job.plans.plan_of`` of the
  run's data config, or ``JobData.plan``): those ``zephon
  plan`` prints and the trainer's loader reads, at any DP degree.
- The cost is O(1) in the step number: one plan lookup of the step's slots
  and the step's samples read from the store; nothing is replayed.
- A step before the first, past a mixture source's ``max_epochs``, a DP rank or
  a sample out of range, a run's left-out list not found or not the one its data
  config binds, is a one-line error (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from torchtitan_zephon.cli.args import int_in
from torchtitan_zephon.cli.open_data import ShowError, add_data_arguments, open_step_data, say_notes
from torchtitan_zephon.job.step_data import MAX_CHARS, StepData
from torchtitan_zephon.order.layout import rank_slice

# ---------------------------------------------------------------- the command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "show",
        help="what a step trains on: sources, sample ids, documents, text",
        description="Print, for each sample of a step (past or future), its source, sample "
        "id, the documents its seq_len input tokens belong to (id, [start:stop) within the "
        "document, /length) and the decoded text. O(1) in the step number.",
    )
    add_data_arguments(p, target="RUN")
    p.add_argument("--step", type=int, required=True, metavar="N", help="the step (1-based)")
    p.add_argument(
        "--dp-degree", type=int_in(1), default=None, metavar="D",
        help="DP degree for --dp-rank (default: for a run, the degree the step was trained "
        "at, or the run's newest for a step not trained yet; else 1)",
    )  # fmt: skip
    p.add_argument(
        "--dp-rank", type=int_in(0), default=None, metavar="R", help="one DP rank's slice"
    )
    p.add_argument(
        "--sample", type=int_in(0), default=None, metavar="K",
        help="only the K-th sample of the step (of the rank's slice with --dp-rank), from 0",
    )  # fmt: skip
    p.add_argument(
        "--max-chars", type=int_in(0), default=MAX_CHARS, metavar="C",
        help=f"characters of text per sample (default {MAX_CHARS}; 0: all)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object for the step")
    return p


def step_samples(
    data: StepData,
    step: int,
    *,
    dp_rank: int | None = None,
    dp_degree: int | None = None,
    sample: int | None = None,
    max_chars: int = MAX_CHARS,
) -> dict[str, Any]:
    """The step's samples (all, one rank's slice, or one) as ``show`` prints them, under
    the data config that trained the step (``StepData.as_trained``)."""
    data = data.as_trained(step)
    data.check_step(step)
    degree, degree_from = (dp_degree, "option") if dp_degree else data.degree_at(step)
    first, gbs = data.plan.step_positions(step)
    if dp_rank is not None:
        if dp_rank >= degree:
            raise ShowError(
                f"--dp-rank {dp_rank} is out of range: DP degree {degree} has ranks 0 .. "
                f"{degree - 1} (set another with --dp-degree)."
            )
        if gbs % degree:
            raise ShowError(
                f"step {step}'s global batch of {gbs} does not split over DP degree {degree}."
            )
    lo, count = (first, gbs) if dp_rank is None else rank_slice(first, gbs, step, dp_rank, degree)
    if sample is not None:
        if sample >= count:
            what = f"DP rank {dp_rank}'s slice" if dp_rank is not None else f"step {step}"
            raise ShowError(
                f"--sample {sample} is out of range: {what} holds samples 0 .. {count - 1}."
            )
        lo, count = lo + sample, 1
    keys = data.plan.ids_for_positions(lo, count)
    positions = data.plan.positions_of(lo, count)
    samples = []
    for k, (key, position) in enumerate(zip(keys.tolist(), positions.tolist(), strict=True)):
        index = lo - first + k
        placed = data.place(step, index, degree)
        placed.pop("rank_index")
        entry = {"index": index, **placed, **data.sample(key, max_chars=max_chars),
                 "position": position}  # fmt: skip
        samples.append(entry)
    quorum = data.history.quorum_at(step) if data.history is not None else None
    return {
        "step": step,
        "status": data.status(step),
        **({} if quorum is None else {"quorum": {k: quorum.get(k) for k in QUORUM_FIELDS}}),
        "slots": [first, first + gbs],
        "global_batch_size": gbs,
        "dp_degree": degree,
        "dp_degree_from": degree_from,
        "samples": samples,
    }


def format_sample(s: dict[str, Any], indent: str = "  ") -> list[str]:
    source = f"source {s['source']}  " if s["source"] else ""
    docs = ", ".join(
        f"{d['document']}[{d['start']}:{d['stop']})/{d['length']}" for d in s.get("documents", [])
    )
    at = f"  position {s['position']}" if "position" in s else ""
    group = ""
    if "part" in s:
        who = "a group not recorded" if s["group"] is None else f"group {s['group']}"
        group = f"{who} (part {s['part']} of {s['parts']}) "
    head = f"{indent}[{s['index']}] {group}rank {s['dp_rank']}  {source}sample {s['sample']}{at}"
    lines = [head + (f"  docs {docs}" if docs else "")]
    if "text" in s:
        lines.append(
            f"{indent}    {json.dumps(s['text'], ensure_ascii=False)}{' ...' if s['text_cut'] else ''}"
        )
    return lines


QUORUM_FIELDS = ("groups", "part", "members", "quorum_id")
"""What ``show --json`` says of the torchft quorum that trained a step."""

DEGREE_FROM = {
    "trained": " (as trained)",
    "current": " (not trained yet: the run's current layout)",
    "option": " (--dp-degree)",
    "default": "",
}
"""How ``show`` says where a step's DP degree comes from (``StepData.degree_at``)."""


def format_step(info: dict[str, Any], what: str) -> list[str]:
    first, end = info["slots"]
    lines = [
        f"step {info['step']} of {what} ({info['status']}): slots {first}..{end - 1}, "
        f"{info['global_batch_size']} samples, DP degree {info['dp_degree']}"
        + DEGREE_FROM[info["dp_degree_from"]]
    ]
    q = info.get("quorum")
    if q is not None:
        lines[0] += (
            f" within each group; trained by a torchft quorum of {q['groups']} replica "
            f"group(s), in parts {', '.join(map(str, range(q['groups'])))} by group(s) "
            f"{', '.join('?' if m is None else str(m) for m in q['members'] or ['?'])}; this "
            f"run folder's group trained part {q['part']}"
        )
    for s in info["samples"]:
        lines += format_sample(s)
    return lines


def run(args: argparse.Namespace) -> int:
    data = open_step_data(args, "show").as_trained(args.step)
    info = step_samples(
        data,
        args.step,
        dp_rank=args.dp_rank,
        dp_degree=args.dp_degree,
        sample=args.sample,
        max_chars=args.max_chars,
    )
    say_notes(data, "show")
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
    else:
        print("\n".join(format_step(info, data.what)))
    return 0
