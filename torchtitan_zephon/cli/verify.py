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
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon import runs
from torchtitan_zephon.runs import format_topology, log_reader, resumes, topology
from torchtitan_zephon.tracker import LOG_NAME, LogReader
from torchtitan_zephon.tracker.blocks import RecordRun
from torchtitan_zephon.tracker.reader import BLOCK_BYTES, record_of_row
from torchtitan_zephon.tracker.writer import head_problem

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


class _Ranges:
    """Consecutive steps folded into [first, last] ranges (at most ``cap`` kept)."""

    def __init__(self, cap: int = 1000) -> None:
        self.items: list[list[int]] = []
        self.cap = cap
        self.steps = 0
        """Every step added, kept in ``items`` or not."""

    def add(self, step: int) -> None:
        self.steps += 1
        if self.items and step == self.items[-1][1] + 1:
            self.items[-1][1] = step
        elif len(self.items) < self.cap:
            self.items.append([step, step])

    def add_range(self, first: int, last: int) -> None:
        """``add`` of every step ``first..last`` in turn, at once."""
        self.steps += last - first + 1
        if self.items and self.items[-1][1] + 1 == first:
            self.items[-1][1] = last
        elif len(self.items) < self.cap:
            self.items.append([first, last])
        elif self.items and first <= self.items[-1][1] + 1 <= last:
            self.items[-1][1] = last


def _fmt_ranges(ranges: list[list[int]]) -> str:
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges)


class _Span:
    """Count, first and last step of a stream of effective records."""

    def __init__(self) -> None:
        self.records, self.first, self.last = 0, None, None

    def add(self, step: int) -> None:
        self.records += 1
        self.first = step if self.first is None else self.first
        self.last = step

    def add_range(self, first: int, last: int) -> None:
        self.records += last - first + 1
        self.first = first if self.first is None else self.first
        self.last = last

    def as_dict(self) -> dict[str, Any]:
        return {"records": self.records, "first": self.first, "last": self.last}


# ---------------------------------------------------------------- checkpoints


def run_folder(log_file: Path) -> Path | None:
    """The run folder a log belongs to (``<run>/zephon/sequence_log.jsonl``), if any."""
    if log_file.name == LOG_NAME and log_file.parent.name == "zephon":
        return log_file.parent.parent
    return None


class CheckpointHeads:
    """The chain heads a run's complete checkpoints saved, checked against its log.

    A checkpoint's Zephon record (``runs.read_data_state``, as the trainer's resume
    check reads it) holds the chain value of the last step it covers; the log must
    hold that value as its effective record of that step (``writer.head_problem``,
    the trainer's test and wording), or a job resuming from the checkpoint is
    refused: the log lost or changed records the checkpoint vouches for. A head found
    only in a superseded record (a checkpoint of a history a later start or resume
    replaced) is a note. Incomplete and corrupt checkpoints are skipped, as a resume
    skips them. Watching the log costs O(checkpoints) per batch of records."""

    def __init__(self, log_file: Path) -> None:
        self.checked: list[dict[str, Any]] = []
        """One entry per checkpoint folder (the ``--json`` report's ``checkpoints``)."""
        self.notes: list[str] = []
        self._found: dict[int, str] = {}
        run = run_folder(log_file)
        for c in runs.checkpoints(run, _checkpoint_folder(run)) if run else []:
            self._add(runs.verify_checkpoint(c))
        self._steps = sorted({e["head"]["step"] for e in self.checked if e["head"]})
        self._wanted = set(self._steps)

    def _add(self, c: runs.CheckpointInfo) -> None:
        entry: dict[str, Any] = {"step": c.step, "path": str(c.path), "status": c.status}
        entry.update(head=None, result="skipped", message=None)
        self.checked.append(entry)
        if c.status != "complete":
            why = "incomplete (no .metadata)" if not c.complete else f"corrupt ({c.problem})"
            self.notes.append(f"checkpoint {c.path} is {why}: skipped, as a resume skips it")
            return
        if c.holds != "training":
            what = "the model only" if c.holds == "model" else "no Zephon data state"
            self.notes.append(f"checkpoint {c.path} holds {what}: not checked")
            return
        try:
            state = runs.read_data_state(c.path)
        except Exception as e:  # noqa: BLE001 - a DCP folder can be broken in many ways
            self.notes.append(
                f"checkpoint {c.path}: its data state is unreadable ({e}): not checked"
            )
            return
        head, done = state.tracker, state.next_step - 1
        if head is None or int(head["step"]) != done or done == 0:
            entry["result"] = "no chain head"  # audit off, or step 0: nothing to hold
            return
        entry["head"] = {"step": done, "chain": str(head["chain"])}

    def watch(
        self, batches: Iterator[RecordRun | list[tuple]]
    ) -> Iterator[RecordRun | list[tuple]]:
        """``batches`` passed through, noting the chains of the steps the heads name."""
        steps, wanted, found = self._steps, self._wanted, self._found
        for batch in batches:
            if not steps:
                pass
            elif isinstance(batch, RecordRun):
                lo = bisect.bisect_left(steps, batch.first)
                for s in steps[lo : bisect.bisect_right(steps, batch.last, lo)]:
                    i = s - batch.first
                    found[s] = batch.chains[32 * i : 32 * i + 32].hex()
            else:
                for row in batch:
                    if int(row[0]) in wanted:
                        found[int(row[0])] = str(row[6])
            yield batch

    def problems(self, log: LogReader) -> list[dict[str, Any]]:
        """After the log's batches were watched to the end: a problem per checkpoint
        whose head the log does not hold (each entry's ``result`` filled in)."""
        pending = []
        for e in self.checked:
            if e["head"] is None:
                continue
            k, chain = e["head"]["step"], e["head"]["chain"]
            problem = head_problem(k, chain, self._found.get(k))
            if problem is None:
                e["result"] = "held"
            elif any(_continued_anyway(ev, k, chain) for ev in log.events):
                e["result"] = "mismatch ignored"
                self.notes.append(
                    f"checkpoint {e['path']}: the log does not hold its chain head ({problem}); "
                    f"a resume from step {k} continued with the mismatch ignored"
                )
            else:
                pending.append((e, problem))
        superseded = _records_of(log.path, [e["head"] for e, _ in pending]) if pending else {}
        out = []
        for e, problem in pending:
            k, chain = e["head"]["step"], e["head"]["chain"]
            line = superseded.get((k, chain))
            if line is not None:
                e["result"] = "superseded"
                self.notes.append(
                    f"checkpoint {e['path']} saved step {k} of a superseded history (its record "
                    f"is line {line}, replaced by a later start or resume): a job resuming from "
                    f"it is refused ({problem})"
                )
                continue
            lost = k not in self._found
            e["result"] = "missing" if lost else "differs"
            e["message"] = (
                f"checkpoint {e['path']} saved the chain head of step {k}, which the log does "
                f"not hold: {problem}. "
                + (
                    "Records the checkpoint vouches for are gone (a cut or deleted line?)"
                    if lost
                    else "The log was edited or belongs to another run"
                )
                + "; a job resuming from that checkpoint is refused"
            )
            out.append({"line": None, "step": k, "kind": "checkpoint", "message": e["message"]})
        return out


def _checkpoint_folder(run: Path) -> str:
    """``checkpoint.folder`` of the job config the run saved, else TorchTitan's default."""
    saved = runs.saved_config(run)
    section = saved[1].get("checkpoint") if saved else None
    folder = section.get("folder") if isinstance(section, dict) else None
    return folder if isinstance(folder, str) and folder else "checkpoint"


def _continued_anyway(event: dict[str, Any], step: int, chain: str) -> bool:
    """A resume from ``step`` that took ``chain`` from the checkpoint and knowingly
    restarted the log's chain there (``zephon.ignore_log_mismatch``, audit off)."""
    return (
        event.get("event") == "resume"
        and event.get("from_step") == step
        and event.get("chain") == chain
        and bool(event.get("log_mismatch_ignored") or event.get("chain_restart"))
    )


def _records_of(path: Path, heads: list[dict[str, Any]]) -> dict[tuple[int, str], int]:
    """``(step, chain) -> line`` of any record (superseded or not) of those heads: one
    pass over the log's bytes, made only for heads the effective history lacks."""
    needles = {h["chain"].encode(): h["step"] for h in heads}
    out: dict[tuple[int, str], int] = {}
    with open(path, "rb") as f:
        lineno = 1
        while block := f.read(BLOCK_BYTES):
            block += f.readline()
            for needle, step in needles.items():
                at = block.find(needle)
                while at >= 0:
                    start = block.rfind(b"\n", 0, at) + 1
                    end = block.find(b"\n", at)
                    end = len(block) if end < 0 else end
                    try:
                        entry = json.loads(block[start:end])
                    except (ValueError, RecursionError):
                        entry = None
                    if (
                        isinstance(entry, dict)
                        and "event" not in entry
                        and entry.get("step") == step
                        and entry.get("chain") == needle.decode()
                    ):
                        out[(step, needle.decode())] = lineno + block.count(b"\n", 0, start)
                    at = block.find(needle, end)
            lineno += block.count(b"\n")
    return out


def integrity(log: LogReader, span: _Span, heads: CheckpointHeads | None = None) -> dict[str, Any]:
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
    span = _Span()
    for batch in heads.watch(log.batches()) if heads else log.batches():
        if isinstance(batch, RecordRun):
            span.add_range(batch.first, batch.last)
        else:
            for row in batch:
                span.add(int(row[0]))
    return integrity(log, span, heads)


def config_difference(a: LogReader, b: LogReader, step: int) -> list[str]:
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


class _Cursor:
    """The head of one log's stream of effective records, batch by batch."""

    def __init__(self, log: LogReader, heads: CheckpointHeads | None = None) -> None:
        self._batches = heads.watch(log.batches()) if heads else log.batches()
        self.batch: RecordRun | list[tuple] | None = None
        self.i = 0
        self._next_batch()

    def _next_batch(self) -> None:
        self.batch, self.i = None, 0
        for batch in self._batches:
            if len(batch):
                self.batch = batch
                return

    @property
    def done(self) -> bool:
        return self.batch is None

    @property
    def run(self) -> RecordRun | None:
        """The head's ``RecordRun`` (consecutive steps, compared in bulk), if it is in one."""
        return self.batch if isinstance(self.batch, RecordRun) else None

    def record(self) -> dict[str, Any]:
        b = self.batch
        return record_of_row(b.row(self.i) if isinstance(b, RecordRun) else b[self.i])

    def advance(self, n: int = 1) -> None:
        self.i += n
        if self.i >= len(self.batch):
            self._next_batch()


class _Comparison:
    """What ``compare_logs`` accumulates while it walks both logs in step order."""

    def __init__(self) -> None:
        self.spans = {"a": _Span(), "b": _Span()}
        self.only = {"a": _Ranges(), "b": _Ranges()}
        self.unbound = _Ranges()
        self.compared = self.matches = self.tokens_compared = 0
        self.lo = self.hi = None
        self.first_mismatch: dict[str, Any] | None = None

    def common(self, first: int, last: int) -> None:
        self.compared += last - first + 1
        self.lo = first if self.lo is None else self.lo
        self.hi = last

    def mismatch(self, a: LogReader, b: LogReader, ra: dict, rb: dict, fields: list) -> None:
        if self.first_mismatch is None:
            step = int(ra["step"])
            self.first_mismatch = {
                "step": step,
                "fields": fields,
                "a": ra,
                "b": rb,
                "config_difference": config_difference(a, b, step),
            }

    def one(self, a: LogReader, b: LogReader, ca: _Cursor, cb: _Cursor) -> None:
        """Take one record from one log or both (either head may be in any batch)."""
        ra = None if ca.done else ca.record()
        rb = None if cb.done else cb.record()
        sa = int(ra["step"]) if ra is not None else None
        sb = int(rb["step"]) if rb is not None else None
        if sa is not None and sb is not None and sa == sb:
            self.spans["a"].add(sa)
            self.spans["b"].add(sb)
            self.common(sa, sa)
            self.tokens_compared += "tokens_digest" in ra and "tokens_digest" in rb
            if ra.get("v", 1) < 2 or rb.get("v", 1) < 2:
                self.unbound.add(sa)
            fields = differing_fields(ra, rb)
            if not fields:
                self.matches += 1
            else:
                self.mismatch(a, b, ra, rb, fields)
            ca.advance()
            cb.advance()
        elif sb is None or (sa is not None and sa < sb):
            self.only["a"].add(sa)
            self.spans["a"].add(sa)
            ca.advance()
        else:
            self.only["b"].add(sb)
            self.spans["b"].add(sb)
            cb.advance()

    def runs(self, a: LogReader, b: LogReader, ca: _Cursor, cb: _Cursor) -> None:
        """Take, at once, the records both heads' runs (or one run, the other log
        done) allow: steps are consecutive, so this is interval arithmetic."""
        if cb.done or ca.done:
            c, side = (ca, "a") if cb.done else (cb, "b")
            first, n = c.run.first + c.i, len(c.run) - c.i
            self.only[side].add_range(first, first + n - 1)
            self.spans[side].add_range(first, first + n - 1)
            c.advance(n)
            return
        ra, rb = ca.run, cb.run
        sa, sb = ra.first + ca.i, rb.first + cb.i
        ea, eb = ra.last, rb.last
        if sa != sb:
            c, side, s, e = (
                (ca, "a", sa, min(ea, sb - 1)) if sa < sb else (cb, "b", sb, min(eb, sa - 1))
            )
            self.only[side].add_range(s, e)
            self.spans[side].add_range(s, e)
            c.advance(e - s + 1)
            return
        e = min(ea, eb)
        n = e - sa + 1
        self.spans["a"].add_range(sa, e)
        self.spans["b"].add_range(sa, e)
        self.common(sa, e)
        ids_a = ra.ids[32 * ca.i : 32 * (ca.i + n)]
        ids_b = rb.ids[32 * cb.i : 32 * (cb.i + n)]
        tokens = ra.tokens is not None and rb.tokens is not None
        tok_a = ra.tokens[32 * ca.i : 32 * (ca.i + n)] if tokens else b""
        tok_b = rb.tokens[32 * cb.i : 32 * (cb.i + n)] if tokens else b""
        self.tokens_compared += n if tokens else 0
        if ids_a == ids_b and tok_a == tok_b:
            self.matches += n
        else:
            differ = _rows_differ(ids_a, ids_b, n)
            if tokens:
                differ |= _rows_differ(tok_a, tok_b, n)
            self.matches += n - int(differ.sum())
            j = int(np.argmax(differ))
            ca.i += j
            cb.i += j
            rec_a, rec_b = ca.record(), cb.record()
            ca.i -= j
            cb.i -= j
            self.mismatch(a, b, rec_a, rec_b, differing_fields(rec_a, rec_b))
        ca.advance(n)
        cb.advance(n)


def _rows_differ(x: bytes, y: bytes, n: int) -> np.ndarray:
    """Which of ``n`` 32-byte digests differ between ``x`` and ``y``."""
    a = np.frombuffer(x, dtype=np.uint8).reshape(n, 32)
    b = np.frombuffer(y, dtype=np.uint8).reshape(n, 32)
    return (a != b).any(axis=1)


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
    record (``_Comparison.one``)."""
    c = _Comparison()
    ca, cb = _Cursor(a, heads_a), _Cursor(b, heads_b)
    while not (ca.done and cb.done):
        if (ca.done or ca.run is not None) and (cb.done or cb.run is not None):
            c.runs(a, b, ca, cb)
        else:
            c.one(a, b, ca, cb)
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
