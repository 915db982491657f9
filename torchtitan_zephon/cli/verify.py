"""``zephon verify RUN_A RUN_B``: did two runs see the same data, step by step?

Reads both runs' sequence logs, resolves their start / resume events to the
effective history (what a resumed job superseded no longer counts), and
compares ``ids_digest`` (and ``tokens_digest`` where both logs have it) at every
step the two histories have in common.

Invariant: exit 0 exactly when there is at least one common step and every
common step matches; 1 otherwise (the first differing step is shown); 2 when an
input is missing or corrupt.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from torchtitan_zephon.runs import format_topology, resumes, sequence_log, topology
from torchtitan_zephon.tracker import LogContents

DIGESTS = ("ids_digest", "tokens_digest")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "verify",
        help="check that two runs saw the same data at every common step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_a", metavar="RUN_A", help="run folder or its zephon/sequence_log.jsonl")
    p.add_argument("run_b", metavar="RUN_B", help="run folder or its zephon/sequence_log.jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def differing_fields(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The digests that differ between two step records (tokens only when both have it)."""
    out = []
    for key in DIGESTS:
        if key == "tokens_digest" and not (key in a and key in b):
            continue
        if a.get(key) != b.get(key):
            out.append(key)
    return out


def compare_logs(a: LogContents, b: LogContents) -> dict[str, Any]:
    """The verify report of two resolved logs (the ``--json`` object)."""
    common = sorted(set(a.records) & set(b.records))
    matches = 0
    first_mismatch = None
    tokens_compared = 0
    for step in common:
        ra, rb = a.records[step], b.records[step]
        tokens_compared += "tokens_digest" in ra and "tokens_digest" in rb
        fields = differing_fields(ra, rb)
        if not fields:
            matches += 1
        elif first_mismatch is None:
            first_mismatch = {"step": step, "fields": fields, "a": ra, "b": rb}
    if not common:
        verdict = "no-overlap"
    else:
        verdict = "match" if first_mismatch is None else "mismatch"
    return {
        "run_a": str(a.path),
        "run_b": str(b.path),
        "steps_compared": len(common),
        "first_common_step": common[0] if common else None,
        "last_common_step": common[-1] if common else None,
        "tokens_compared": tokens_compared,
        "matches": matches,
        "first_mismatch": first_mismatch,
        "resumes_a": resumes(a),
        "resumes_b": resumes(b),
        "starts_a": _starts(a),
        "starts_b": _starts(b),
        "steps_a": _range(a),
        "steps_b": _range(b),
        "truncated_tail_a": a.truncated_tail,
        "truncated_tail_b": b.truncated_tail,
        "verdict": verdict,
    }


def _starts(log: LogContents) -> list[dict[str, Any]]:
    return [topology(e) for e in log.events if e.get("event") == "start"]


def _range(log: LogContents) -> dict[str, Any]:
    steps = log.steps()
    return {
        "records": len(steps),
        "first": steps[0] if steps else None,
        "last": steps[-1] if steps else None,
    }


def _short(record: dict[str, Any]) -> str:
    shown = {
        k: (v[:16] + "..." if isinstance(v, str) and len(v) > 19 else v) for k, v in record.items()
    }
    return json.dumps(shown, sort_keys=True)


def format_report(r: dict[str, Any]) -> str:
    lines = []
    for side in ("a", "b"):
        rng = r[f"steps_{side}"]
        span = f"steps {rng['first']}..{rng['last']}" if rng["records"] else "no step records"
        lines.append(f"{side.upper()}: {r[f'run_{side}']}")
        lines.append(f"   {span} ({rng['records']} effective records)")
        starts = r[f"starts_{side}"]
        if starts:  # the last start is the job the effective history begins with
            lines.append(f"   started at step 0: {format_topology(starts[-1])}")
        res = r[f"resumes_{side}"]
        for ev in res:
            lines.append(f"   resumed from step {ev['from_step']}: {format_topology(ev)}")
        if not res:
            lines.append("   no resumes")
        if r[f"truncated_tail_{side}"]:
            lines.append("   last line truncated (a job died mid-write); ignored")
    n = r["steps_compared"]
    if n:
        what = "ids" + (f" + tokens ({r['tokens_compared']} steps)" if r["tokens_compared"] else "")
        lines.append(
            f"compared:  {n} common steps ({r['first_common_step']}..{r['last_common_step']}), {what}"
        )
        lines.append(f"matches:   {r['matches']}/{n}")
    mm = r["first_mismatch"]
    if mm:
        lines.append(f"first mismatch at step {mm['step']} ({', '.join(mm['fields'])} differ):")
        lines.append(f"   A: {_short(mm['a'])}")
        lines.append(f"   B: {_short(mm['b'])}")
    if r["verdict"] == "match":
        lines.append(f"verdict: MATCH: both runs saw identical data at all {n} common steps")
    elif r["verdict"] == "mismatch":
        lines.append(f"verdict: MISMATCH: the runs saw different data from step {mm['step']}")
    else:
        lines.append("verdict: NO OVERLAP: the runs have no step in common, nothing to compare")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    a, b = sequence_log(args.run_a), sequence_log(args.run_b)
    report = compare_logs(a, b)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["verdict"] == "match" else 1
