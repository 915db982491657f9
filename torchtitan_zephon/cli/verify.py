"""``zephon verify RUN [RUN_B]``: is a sequence log intact, and did two runs see the same data?

With one run: recomputes the hash chain of every record, checks step order and
the links of start / resume events, and names the first bad step.

With two runs: checks both logs the same way, resolves their start / resume
events to the effective history (what a resumed job superseded no longer
counts), and compares ``ids_digest`` (and ``tokens_digest`` where both logs have
it) at every step the two histories have in common. Each step's ``ids_digest``
binds the data config that governed it (store content, tokenizer, seq_len,
held-out split, seed, order format) and the step's positions, so runs that
differ in any of these never match even where their sample ids coincide.

Invariant: exit 0 exactly when the logs are intact and (with two runs) there is
at least one common step, every common step matches and every compared record
is bound to its data config; 1 otherwise (a broken log, a mismatch, records of
tracker format 1 ("unbound", written before records bound the config), or no
overlap); 2 when an input is missing or unreadable.
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
        help="check a run's sequence log, or that two runs saw the same data at every common step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_a", metavar="RUN", help="run folder or its zephon/sequence_log.jsonl")
    p.add_argument(
        "run_b",
        metavar="RUN_B",
        nargs="?",
        help="a second run to compare with (omit to check RUN's log alone)",
    )
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


def _ranges(steps: list[int]) -> list[list[int]]:
    """[[first, last], ...] runs of consecutive steps."""
    out: list[list[int]] = []
    for s in steps:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return out


def _fmt_ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


def integrity(log: LogContents) -> dict[str, Any]:
    """The one-log report: intact or the first problem, notes, unbound steps."""
    first = log.problems[0] if log.problems else None
    return {
        "path": str(log.path),
        "intact": first is None,
        "problems": len(log.problems),
        "first_problem": None
        if first is None
        else {"line": first.line, "step": first.step, "kind": first.kind, "message": first.message},
        "notes": list(log.notes),
        "unbound_steps": _ranges(log.unbound_steps()),
        "steps": _range(log),
        "starts": _starts(log),
        "resumes": resumes(log),
        "truncated_tail": log.truncated_tail,
    }


def config_difference(a: LogContents, b: LogContents, step: int) -> list[str]:
    """``field: A -> B`` for each data-config field that differs between the jobs that
    wrote step ``step`` in each log (empty when unknown or equal)."""
    ea, eb = a.event_for(step), b.event_for(step)
    ca = (ea or {}).get("data_config")
    cb = (eb or {}).get("data_config")
    if not isinstance(ca, dict) or not isinstance(cb, dict):
        return []
    return [
        f"{k}: {ca.get(k, '<absent>')!r} -> {cb.get(k, '<absent>')!r}"
        for k in sorted(set(ca) | set(cb))
        if ca.get(k) != cb.get(k)
    ]


def compare_logs(a: LogContents, b: LogContents) -> dict[str, Any]:
    """The verify report of two resolved logs (the ``--json`` object)."""
    common = sorted(set(a.records) & set(b.records))
    lo, hi = (common[0], common[-1]) if common else (None, None)
    matches = 0
    first_mismatch = None
    tokens_compared = 0
    unbound = []
    for step in common:
        ra, rb = a.records[step], b.records[step]
        tokens_compared += "tokens_digest" in ra and "tokens_digest" in rb
        if ra.get("v", 1) < 2 or rb.get("v", 1) < 2:
            unbound.append(step)
        fields = differing_fields(ra, rb)
        if not fields:
            matches += 1
        elif first_mismatch is None:
            first_mismatch = {
                "step": step,
                "fields": fields,
                "a": ra,
                "b": rb,
                "config_difference": config_difference(a, b, step),
            }
    ia, ib = integrity(a), integrity(b)
    if not (ia["intact"] and ib["intact"]):
        verdict = "corrupt"
    elif not common:
        verdict = "no-overlap"
    elif first_mismatch is not None:
        verdict = "mismatch"
    elif unbound:
        verdict = "unbound"
    else:
        verdict = "match"
    only = {}
    for side, mine, other in (("a", a, b), ("b", b, a)):
        # inside the common range a step in one log only is a hole in the other
        only[side] = _ranges(
            sorted(
                s
                for s in mine.records
                if s not in other.records and lo is not None and lo <= s <= hi
            )
        )
    return {
        "run_a": str(a.path),
        "run_b": str(b.path),
        "steps_compared": len(common),
        "first_common_step": lo,
        "last_common_step": hi,
        "tokens_compared": tokens_compared,
        "matches": matches,
        "first_mismatch": first_mismatch,
        "unbound_steps": _ranges(unbound),
        "only_in_a": only["a"],
        "only_in_b": only["b"],
        "integrity_a": ia,
        "integrity_b": ib,
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


def _describe_log(label: str, r: dict[str, Any]) -> list[str]:
    rng = r["steps"]
    span = f"steps {rng['first']}..{rng['last']}" if rng["records"] else "no step records"
    lines = [f"{label}{r['path']}", f"   {span} ({rng['records']} effective records)"]
    if r["starts"]:  # the last start is the job the effective history begins with
        lines.append(f"   started at step 0: {format_topology(r['starts'][-1])}")
    for ev in r["resumes"]:
        lines.append(f"   resumed from step {ev['from_step']}: {format_topology(ev)}")
    if not r["resumes"]:
        lines.append("   no resumes")
    if r["truncated_tail"]:
        lines.append("   last line truncated (a job died mid-write); ignored")
    for note in r["notes"]:
        lines.append(f"   note: {note}")
    if r["unbound_steps"]:
        lines.append(
            f"   unbound: steps {_fmt_ranges(r['unbound_steps'])} were written by tracker "
            "format 1 (their digests do not bind the data config)"
        )
    p = r["first_problem"]
    if p:
        lines.append(f"   BROKEN: {p['message']} ({r['problems']} problem(s) in all)")
    else:
        lines.append("   chain: intact (every record follows from the one before it)")
    return lines


def format_report(r: dict[str, Any]) -> str:
    lines = _describe_log("A: ", r["integrity_a"]) + _describe_log("B: ", r["integrity_b"])
    n = r["steps_compared"]
    if n:
        what = "ids" + (f" + tokens ({r['tokens_compared']} steps)" if r["tokens_compared"] else "")
        lines.append(
            f"compared:  {n} common steps ({r['first_common_step']}..{r['last_common_step']}), {what}"
        )
        lines.append(f"matches:   {r['matches']}/{n}")
    for side in ("a", "b"):
        if r[f"only_in_{side}"]:
            lines.append(
                f"only in {side.upper()} (missing from the other): steps "
                f"{_fmt_ranges(r[f'only_in_{side}'])}"
            )
    mm = r["first_mismatch"]
    if mm:
        lines.append(f"first mismatch at step {mm['step']} ({', '.join(mm['fields'])} differ):")
        lines.append(f"   A: {_short(mm['a'])}")
        lines.append(f"   B: {_short(mm['b'])}")
        if mm["config_difference"]:
            lines.append("   the data configs differ (A -> B):")
            lines += [f"     {d}" for d in mm["config_difference"]]
    v = r["verdict"]
    if v == "match":
        lines.append(f"verdict: MATCH: both runs saw identical data at all {n} common steps")
    elif v == "corrupt":
        bad = [s.upper() for s in ("a", "b") if not r[f"integrity_{s}"]["intact"]]
        lines.append(
            f"verdict: BROKEN LOG: the sequence log of {' and '.join(bad)} does not verify; "
            "it proves nothing about the steps after the first problem"
        )
    elif v == "mismatch":
        lines.append(f"verdict: MISMATCH: the runs saw different data from step {mm['step']}")
    elif v == "unbound":
        lines.append(
            f"verdict: UNBOUND: the digests agree at all {n} common steps, but steps "
            f"{_fmt_ranges(r['unbound_steps'])} were logged by an older zephon whose digests "
            "do not bind the data config (seq_len, held-out split, ...): not a proof"
        )
    else:
        lines.append("verdict: NO OVERLAP: the runs have no step in common, nothing to compare")
    return "\n".join(lines)


def format_single(r: dict[str, Any]) -> str:
    lines = _describe_log("log: ", r)
    if r["intact"]:
        lines.append(f"verdict: INTACT: {r['steps']['records']} effective records, chain verified")
    else:
        p = r["first_problem"]
        where = f"step {p['step']}" if p["step"] is not None else f"line {p['line']}"
        lines.append(f"verdict: BROKEN at {where}: {p['message']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    a = sequence_log(args.run_a)
    if args.run_b is None:
        report = integrity(a)
        print(json.dumps(report, indent=2) if args.json else format_single(report))
        return 0 if report["intact"] else 1
    report = compare_logs(a, sequence_log(args.run_b))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["verdict"] == "match" else 1
