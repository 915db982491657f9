"""Two sequence logs compared step by step: the heart of ``zephon verify A B``.

Role: walk the effective histories of two logs (``LogReader.batches()``) as a merge
in step order; at every step both have, compare ``ids_digest`` (and
``tokens_digest`` where both logs have it); count the steps only one has, the
records not bound to their data config (tracker format 1), and keep the first
mismatch with the data-config fields that differ (and, when the runs' skip entries
differ at or before it, the step where they do, in words; the same for their
left-out entries). ``cli/verify.py`` turns the
outcome into the report and the verdict.

Invariant: memory is bounded by the number of events and gaps, never by the
number of steps; where both heads are in runs of consecutive records
(``fast_path.RecordRun``) the merge advances a run at a time and compares digests in
bulk, with the same outcome as record by record (``Comparison.one``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from torchtitan_zephon.order.data_config import SKIP_FIELD
from torchtitan_zephon.order.exclusions import EXCLUDE_FIELD, entries_up_to
from torchtitan_zephon.order.skips import SkipSteps
from torchtitan_zephon.tracker.fast_path import RecordRun
from torchtitan_zephon.tracker.reader import LogReader, record_of_row

DIGESTS = ("ids_digest", "tokens_digest")


class Watch(Protocol):
    """What watches a log's batches as they pass (``cli.checkpoint_heads.CheckpointHeads``)."""

    def watch(
        self, batches: Iterator[RecordRun | list[tuple]]
    ) -> Iterator[RecordRun | list[tuple]]: ...


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


class Span:
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


def skip_difference(a: LogReader, b: LogReader, step: int) -> dict[str, Any] | None:
    """Where the skip entries (``order.skips``) of the jobs that wrote step ``step`` in
    each log first differ: ``{"step": S, "text": words}``, or None (the same skips, or
    unknown). Entries after ``step`` do not count: they govern later steps only."""
    ca = ((a.event_for(step) or {}).get("data_config") or {}).get(SKIP_FIELD)
    cb = ((b.event_for(step) or {}).get("data_config") or {}).get(SKIP_FIELD)
    try:
        sa, sb = SkipSteps.from_json(ca).up_to(step), SkipSteps.from_json(cb).up_to(step)
    except ValueError:
        return None
    if sa == sb:
        return None
    first = min(s for s, _ in set(sa.entries) ^ set(sb.entries))

    def what(skips: SkipSteps) -> str:
        n = dict(skips.entries).get(first)
        if n is None:
            return "does not skip there"
        return f"skips the data of {n} step{'s' * (n != 1)} there (skip_steps {first}:{n})"

    return {
        "step": first,
        "text": f"at step {first}, A {what(sa)} and B {what(sb)}: the runs are meant to "
        f"differ from step {first} on",
    }


def exclusion_difference(a: LogReader, b: LogReader, step: int) -> dict[str, Any] | None:
    """Where the left-out entries (``order.exclusions``) of the jobs that wrote step
    ``step`` in each log first differ: ``{"step": S, "text": words}``, or None (the
    same lists, or unknown). Entries after ``step`` do not count."""
    ca = ((a.event_for(step) or {}).get("data_config") or {}).get(EXCLUDE_FIELD)
    cb = ((b.event_for(step) or {}).get("data_config") or {}).get(EXCLUDE_FIELD)
    try:
        ea, eb = entries_up_to(ca, step), entries_up_to(cb, step)
        if ea == eb:
            return None
        first = min(int(e["from_step"]) for e in ea + eb if (e in ea) != (e in eb))
    except (TypeError, ValueError, KeyError):
        return None

    def what(entries: list[Any]) -> str:
        here = [e for e in entries if int(e["from_step"]) == first]
        if not here:
            return "leaves out no new sample there"
        parts = [
            f"{e['ids']} id{'s' * (e['ids'] != 1)}"
            + (f" of source {e['source']!r}" if "source" in e else "")
            + f" (sha256 {str(e['sha256'])[:12]})"
            for e in here
        ]
        return "leaves out " + ", ".join(parts) + " from there"

    return {
        "step": first,
        "text": f"at step {first}, A {what(ea)} and B {what(eb)} (exclude): the runs are "
        f"meant to differ from step {first} on",
    }


class _Cursor:
    """The head of one log's stream of effective records, batch by batch."""

    def __init__(self, log: LogReader, heads: Watch | None = None) -> None:
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


class Comparison:
    """What ``compare`` accumulates while it walks both logs in step order."""

    def __init__(self) -> None:
        self.spans = {"a": Span(), "b": Span()}
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
                "skip_difference": skip_difference(a, b, step),
                "exclusion_difference": exclusion_difference(a, b, step),
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


def compare(
    a: LogReader, b: LogReader, heads_a: Watch | None = None, heads_b: Watch | None = None
) -> Comparison:
    """Walk both logs to their ends (their batches watched by ``heads_a``, ``heads_b``);
    what the walk found. Records are taken in step order, as a merge of the two
    effective histories; runs of consecutive records are taken a run at a time."""
    c = Comparison()
    ca, cb = _Cursor(a, heads_a), _Cursor(b, heads_b)
    while not (ca.done and cb.done):
        if (ca.done or ca.run is not None) and (cb.done or cb.run is not None):
            c.runs(a, b, ca, cb)
        else:
            c.one(a, b, ca, cb)
    return c
