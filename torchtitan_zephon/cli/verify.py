"""``zephon verify RUN [RUN_B]``: is a sequence log intact, and did two runs see the same data?

With one run: recomputes the hash chain of every record, checks step order and
the links of start / resume events, and names the first bad step (a deleted,
repeated or out-of-order record says which). In a run folder the log is also
checked against its complete checkpoints: each one's saved chain head must be
the log's record of that step, as a resume requires, so a log that lost records
a checkpoint vouches for (a cut or deleted last line) is broken, naming the
checkpoint and step. A torn last line beyond the latest complete checkpoint is
only noted (a crash mid-write).

With two runs: checks both logs the same way, resolves their start / resume
events to the effective history (what a resumed job superseded no longer
counts), and compares ``ids_digest`` (and ``tokens_digest`` where both logs have
it) at every step the two histories have in common. Each step's ``ids_digest``
binds the data config that governed it (store content, tokenizer, seq_len,
held-out split, seed, order format) and the step's positions, so runs that
differ in any of these never match even where their sample ids coincide. Steps
one history has and the other lacks are listed and counted.

Invariant: exit 0 exactly when the logs are intact (their chains, and the heads
their runs' complete checkpoints saved) and (with two runs) there is
at least one common step, every common step matches and every compared record
is bound to its data config; 1 otherwise (a broken log, a mismatch, records of
tracker format 1 ("unbound", written before records bound the config), or no
overlap); 2 when an input is missing or unreadable.

The walk over two logs is ``tracker.compare``; the checkpoints' chain heads are
checked by ``cli.checkpoint_heads``; this module is the command and its report.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from torchtitan_zephon.cli.checkpoint_heads import CheckpointHeads
from torchtitan_zephon.run.recorded import format_topology, log_reader, resumes, topology
from torchtitan_zephon.tracker import LogReader
from torchtitan_zephon.tracker.compare import Span, compare
from torchtitan_zephon.tracker.fast_path import RecordRun


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


def _fmt_ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


def integrity(log: LogReader, span: Span, heads: CheckpointHeads | None = None) -> dict[str, Any]:
    """The one-log report (after ``log.batches()`` was exhausted, watched by ``heads``)."""
    first = log.problems[0] if log.problems else None
    unheld = heads.problems(log) if heads else []  # checkpoints whose heads the log lacks
    return {
        "path": str(log.path),
        "intact": first is None and not unheld,
        "problems": log.problem_count + len(unheld),
        "first_problem": (unheld[0] if unheld else None)
        if first is None
        else {"line": first.line, "step": first.step, "kind": first.kind, "message": first.message},
        "notes": list(log.notes) + (heads.notes if heads else []),
        "checkpoints": heads.checked if heads else [],
        "unbound_steps": [list(r) for r in log.unbound],
        "steps": span.as_dict(),
        "starts": [topology(e) for e in log.events if e.get("event") == "start"],
        "resumes": resumes(log),
        "truncated_tail": log.truncated_tail,
    }


def check_log(log: LogReader, heads: CheckpointHeads | None = None) -> dict[str, Any]:
    """Check one log alone, streaming (and against its run's checkpoints: ``heads``)."""
    span = Span()
    for batch in heads.watch(log.batches()) if heads else log.batches():
        if isinstance(batch, RecordRun):
            span.add_range(batch.first, batch.last)
        else:
            for row in batch:
                span.add(int(row[0]))
    return integrity(log, span, heads)


def compare_logs(
    a: LogReader,
    b: LogReader,
    heads_a: CheckpointHeads | None = None,
    heads_b: CheckpointHeads | None = None,
) -> dict[str, Any]:
    """The verify report of two logs (the ``--json`` object), streamed: memory is
    bounded by the number of events and gaps, never by the number of steps. Each
    log is also checked against its run's checkpoints (``heads_a``, ``heads_b``).

    Records are taken in step order, as a merge of the two effective histories;
    where both heads are in runs of consecutive records the merge advances a run
    at a time and compares digests in bulk, with the same outcome as record by
    record (``tracker.compare.Comparison.one``)."""
    c = compare(a, b, heads_a, heads_b)
    ia_report = integrity(a, c.spans["a"], heads_a)
    ib_report = integrity(b, c.spans["b"], heads_b)
    if not (ia_report["intact"] and ib_report["intact"]):
        verdict = "corrupt"
    elif not c.compared:
        verdict = "no-overlap"
    elif c.first_mismatch is not None:
        verdict = "mismatch"
    elif c.unbound.items:
        verdict = "unbound"
    else:
        verdict = "match"
    return {
        "run_a": str(a.path),
        "run_b": str(b.path),
        "steps_compared": c.compared,
        "first_common_step": c.lo,
        "last_common_step": c.hi,
        "tokens_compared": c.tokens_compared,
        "matches": c.matches,
        "first_mismatch": c.first_mismatch,
        "unbound_steps": c.unbound.items,
        "only_in_a": c.only["a"].items,
        "only_in_b": c.only["b"].items,
        "steps_only_in_a": c.only["a"].steps,
        "steps_only_in_b": c.only["b"].steps,
        "integrity_a": ia_report,
        "integrity_b": ib_report,
        "resumes_a": ia_report["resumes"],
        "resumes_b": ib_report["resumes"],
        "starts_a": ia_report["starts"],
        "starts_b": ib_report["starts"],
        "steps_a": ia_report["steps"],
        "steps_b": ib_report["steps"],
        "truncated_tail_a": a.truncated_tail,
        "truncated_tail_b": b.truncated_tail,
        "verdict": verdict,
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
    held = [f"step-{c['step']}" for c in r["checkpoints"] if c["result"] == "held"]
    if held:
        lines.append(f"   checkpoints: the log holds the chain heads of {', '.join(held)}")
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
        if mm.get("skip_difference"):
            lines.append(f"   skips: {mm['skip_difference']['text']}")
        if mm.get("exclusion_difference"):
            lines.append(f"   left out: {mm['exclusion_difference']['text']}")
    v = r["verdict"]
    if v == "match":
        verdict = f"verdict: MATCH: both runs saw identical data at all {n} common steps"
    elif v == "corrupt":
        bad = [s.upper() for s in ("a", "b") if not r[f"integrity_{s}"]["intact"]]
        verdict = (
            f"verdict: BROKEN LOG: the sequence log of {' and '.join(bad)} does not verify; "
            "it proves nothing about the steps after the first problem"
        )
    elif v == "mismatch":
        verdict = f"verdict: MISMATCH: the runs saw different data from step {mm['step']}"
        skip = mm.get("skip_difference")
        if skip and skip["step"] == mm["step"]:
            verdict += f" (where their skip_steps differ: {skip['text'].split(': ')[0]})"
        excl = mm.get("exclusion_difference")
        if excl and excl["step"] == mm["step"]:
            verdict += f" (where their left-out samples differ: {excl['text'].split(': ')[0]})"
    elif v == "unbound":
        verdict = (
            f"verdict: UNBOUND: the digests agree at all {n} common steps, but steps "
            f"{_fmt_ranges(r['unbound_steps'])} were logged by an older zephon whose digests "
            "do not bind the data config (seq_len, held-out split, ...): not a proof"
        )
    else:
        verdict = "verdict: NO OVERLAP: the runs have no step in common, nothing to compare"
    na, nb = r["steps_only_in_a"], r["steps_only_in_b"]
    lines.append(f"{verdict}; A has {na} step{'s' * (na != 1)} beyond B, B has {nb} beyond A")
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
    if args.run_b is None:
        a = log_reader(args.run_a)
        report = check_log(a, CheckpointHeads(a.path))
        print(json.dumps(report, indent=2) if args.json else format_single(report))
        return 0 if report["intact"] else 1
    a = log_reader(args.run_a, forked=True)
    b = log_reader(args.run_b, forked=True)  # the readers work while the checkpoints are read
    report = compare_logs(a, b, CheckpointHeads(a.path), CheckpointHeads(b.path))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["verdict"] == "match" else 1
