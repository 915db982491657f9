"""Reading a sequence log: effective history and integrity, streamed.

A log is read in two passes, a few MB at a time (``BLOCK_BYTES``). The first
parses only the start / resume events (a few per job). The second streams the
step records in file order, recomputes each chain from the one before it, checks
step order and event links, and yields the records of the *effective history*
(those no later event supersedes) in increasing step order. A block of record
lines in the writer's layout is checked at once (``blocks.check_block``: one
sha256 per line, the rest column-wise) and comes out as a ``RecordRun``; any
block it does not accept is read line by line, as with ``fast=False``.

Invariants:
- Memory is bounded by the number of events, the block size and MAX_GAPS, never
  by the number of steps: ``LogReader.batches()`` yields; only ``read_log``
  materialises a dict.
- The block fast path changes nothing but speed: ``batches()`` gives the same
  rows, problems, notes and errors with ``fast=True`` and ``fast=False``
  (tests/test_tracker_blocks.py tampers with logs to try to break this).
- Every record's chain is recomputed (``records.chain_of_line`` on the line's
  bytes, or from the parsed body for lines of older layouts); the first record
  whose chain, step order or resume link is wrong is reported with its line and
  step. A deleted, inserted, reordered or edited record never goes unnoticed.
  A step-order problem says which it is: a step missing (its record never comes),
  out of order (its record comes further on: ``_Order`` follows the skipped steps),
  or repeated.
- A truncated last line (a crash mid-write) is tolerated and reported; an
  unparsable line anywhere else is a TrackerError naming the line.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.store.format import fingerprint
from torchtitan_zephon.tracker.blocks import RecordRun, check_block
from torchtitan_zephon.tracker.records import (
    LOG_NAME,
    RECORD_LINE,
    TrackerError,
    chain_next,
    chain_of_line,
    fields_of_line,
    genesis,
    log_path,
)

FIELDS = ("step", "first_position", "num_samples", "ids_digest", "tokens_digest", "v", "chain")
"""A record's fields in the order ``LogReader.rows()`` gives them."""
MAX_PROBLEMS = 100
"""Problems kept in detail; the rest are counted."""


@dataclass
class LogProblem:
    """The first place where a log stops being its own proof."""

    line: int
    step: int | None
    kind: str
    """``chain`` (a record's chain does not follow), ``order`` (a gap, a repeated or
    reordered step), ``event`` (a start or resume event that does not link up),
    ``orphan`` (a step record before any start event)."""
    message: str


MAX_GAPS = 1000
"""Skipped ranges followed in detail; past this the reader no longer tells a missing
step from an out-of-order one (until the next start event)."""


class _Gap:
    """Steps a forward jump in the log skipped: reported missing (``problem``) until one
    of them turns up further on; the problem then says the log is out of order."""

    def __init__(self, line: int, step: int, problem: LogProblem | None) -> None:
        self.line, self.step, self.problem = line, step, problem
        """The line of the record that jumped ahead, its step, the problem said there."""
        self.filled = False


class _Order:
    """Which steps of the current history the log has shown so far, in O(gaps) memory:
    every step in ``floor + 1 .. high`` has had a record except the ``missing`` ranges
    (sorted, disjoint, each with the gap that skipped it). Tells a deleted record from
    one that comes later (out of order) or again (repeated). ``high`` None: not
    followed (before a start event, or past MAX_GAPS)."""

    def __init__(self) -> None:
        self.high: int | None = None
        self.floor = 0
        self.missing: list[list] = []  # [first, last, _Gap]

    def event(self, kind: Any, k: int) -> None:
        """A start event (the history begins again) or a resume from step ``k``."""
        if kind == "start":
            self.high, self.floor, self.missing = k, k, []
        elif self.high is None:
            return
        elif k <= self.high:
            self.high = k
            self.missing = [[a, min(b, k), g] for a, b, g in self.missing if a <= k]
        else:  # a resume from a step the log never reached: the steps up to k unknown
            self.high = self.floor = k

    def knows(self, step: int) -> bool:
        """Whether the log so far says if ``step`` had its record."""
        return self.high is not None and self.floor < step <= self.high

    def _overlapping(self, first: int, last: int) -> tuple[int, int]:
        """The slice of ``missing`` whose ranges overlap ``first..last`` (O(log gaps))."""
        lo = bisect.bisect_left(self.missing, first, key=lambda r: r[1])
        hi = bisect.bisect_right(self.missing, last, lo, key=lambda r: r[0])
        return lo, hi

    def is_missing(self, step: int) -> bool:
        lo, hi = self._overlapping(step, step)
        return lo < hi

    def unseen(self, first: int, last: int) -> list[int]:
        """The first step of each stretch of ``first..last`` with no record so far
        (the first two at most: enough to tell none, one and more)."""
        if self.high is None or first <= self.floor:
            return [first]
        lo, hi = self._overlapping(first, last)
        out = [max(a, first) for a, _, _ in self.missing[lo : min(hi, lo + 2)]]
        if last > self.high:
            out.append(max(first, self.high + 1))
        return out

    def skipped(self, first: int, last: int, gap: _Gap) -> None:
        """A forward jump left ``first..last`` without records (what lies beyond
        ``high`` is new)."""
        if self.high is None:
            return
        first = max(first, self.high + 1)
        if first <= last:
            if len(self.missing) >= MAX_GAPS:
                self.high = None  # too disordered to follow
                return
            self.missing.append([first, last, gap])

    def saw(self, first: int, last: int, line: int, prev: int | None) -> None:
        """Records of the consecutive steps ``first..last``, the first at ``line`` after
        a record of step ``prev``. The first record a gap was missing turns the gap's
        problem into an out-of-order one."""
        if self.high is None:
            return
        if first <= self.high and self.missing:
            lo, hi = self._overlapping(first, last)
            out = []
            for a, b, g in self.missing[lo:hi]:
                if not g.filled:
                    g.filled = True
                    s = max(a, first)
                    after = prev if s == first else s - 1
                    if g.problem is not None:
                        g.problem.message = (
                            f"line {g.line}: out of order (step {s} after step {after}): the "
                            f"record of step {s} belongs before this line's record of step "
                            f"{g.step} but is at line {line + s - first}"
                        )
                if a < first:
                    out.append([a, first - 1, g])
                if b > last:
                    out.append([last + 1, b, g])
            self.missing[lo:hi] = out
            if len(self.missing) > MAX_GAPS:  # split past the bound: too disordered to follow
                self.high, self.missing = None, []
                return
        self.high = max(self.high, last)

    def finish(self) -> None:
        """At the end of the log: an out-of-order gap's steps that never came are named."""
        left: dict[int, list[list]] = {}
        for r in self.missing:
            if r[2].filled and r[2].problem is not None:
                left.setdefault(id(r[2]), []).append(r)
        for ranges in left.values():
            (a, b, g), n = ranges[0], sum(b - a + 1 for a, b, _ in ranges)
            if len(ranges) == 1:
                what = f"step {a} is" if a == b else f"steps {a}..{b} are"
            else:
                what = f"{n} of its steps, from step {a} on, are"
            g.problem.message += f"; {what} missing (deleted?)"


def resolve(path: str | os.PathLike) -> Path:
    """The log file of a run folder, a zephon/ folder or a log path."""
    path = Path(path)
    if path.is_dir():
        path = log_path(path) if not (path / LOG_NAME).exists() else path / LOG_NAME
    if not path.is_file():
        raise TrackerError(
            f"no sequence log at {path}: expected <dump_folder>/zephon/{LOG_NAME}, "
            "written by runs with zephon.audit = 'ids' or 'tokens'"
        )
    return path


def count_lines(piece: bytes) -> int:
    """Newlines in ``piece`` (numpy counts several times faster than bytes.count)."""
    return int(np.count_nonzero(np.frombuffer(piece, dtype=np.uint8) == 10))


def has_event(piece: bytes) -> bool:
    """``b'"event"' in piece``, found from the few places a ``v`` is (one per record)."""
    buf = np.frombuffer(piece, dtype=np.uint8)
    v = np.flatnonzero(buf == ord("v"))
    v = v[(v >= 2) & (v + 5 <= len(buf))]
    return bool(
        (
            (buf[v - 2] == ord('"')) & (buf[v - 1] == ord("e")) & (buf[v + 1] == ord("e"))
            & (buf[v + 2] == ord("n")) & (buf[v + 3] == ord("t")) & (buf[v + 4] == ord('"'))
        ).any()
    )  # fmt: skip


BLOCK_BYTES = 4 << 20
"""How much of the log the reader takes at once (whole lines; at least one line)."""


class LogReader:
    """One sequence log, read lazily: events up front, records streamed.

    ``fast=False`` reads every line on its own (the reference the block fast path
    of ``blocks.check_block`` is tested against)."""

    def __init__(self, path: str | os.PathLike, *, fast: bool = True) -> None:
        self.path = resolve(path)
        self.fast = fast
        self.events: list[dict[str, Any]] = []
        """Start and resume events in log order."""
        self._event_lines: list[int] = []
        self._event_offsets: list[int] = []
        self.truncated_tail = False
        """The last line was cut short (a crash mid-write); it was ignored."""
        self.problems: list[LogProblem] = []
        """Integrity problems in log order (the first MAX_PROBLEMS)."""
        self.problem_count = 0
        self.notes: list[str] = []
        """Things that are not errors but limit what the log proves."""
        self.unbound: list[list[int]] = []
        """Ranges of effective steps written by tracker format 1 (filled by records())."""
        self.last_line = 0
        self._end = 0
        """Byte offset just past the last line of the first pass: the second reads no further."""
        self._scan_events()

    # -- pass 1: events --------------------------------------------------
    def _pieces(self) -> Iterator[tuple[int, int, bytes, int]]:
        """(line number, byte offset, bytes, newlines) of the log in pieces of whole
        lines; a last line without its newline comes as a piece of its own."""
        with open(self.path, "rb") as f:
            lineno, offset = 1, 0
            while piece := f.read(BLOCK_BYTES):
                if not piece.endswith(b"\n"):
                    piece += f.readline()
                    cut = piece.rfind(b"\n") + 1
                    if 0 < cut < len(piece):  # the file's last line, without its newline
                        head, piece = piece[:cut], piece[cut:]
                        newlines = count_lines(head)
                        yield lineno, offset, head, newlines
                        lineno, offset = lineno + newlines, offset + cut
                newlines = count_lines(piece)
                yield lineno, offset, piece, newlines
                lineno, offset = lineno + newlines, offset + len(piece)

    @staticmethod
    def _split(lineno: int, offset: int, piece: bytes) -> Iterator[tuple[int, int, bytes]]:
        """(line number, offset, raw line with its newline) of each line of a piece."""
        at = 0
        while at < len(piece):
            nl = piece.find(b"\n", at) + 1 or len(piece)
            yield lineno, offset + at, piece[at:nl]
            lineno += 1
            at = nl

    def _scan_events(self) -> None:
        for lineno0, offset0, piece, newlines in self._pieces():
            if piece.endswith(b"\n") and not has_event(piece):
                text = piece.rstrip()  # the last non-blank line is the last one to read
                if text:
                    self.last_line = lineno0 + newlines - piece.count(b"\n", len(text))
                    self._end = offset0 + piece.index(b"\n", len(text)) + 1
                continue
            for lineno, offset, raw in self._split(lineno0, offset0, piece):
                if not raw.endswith(b"\n"):  # the last line, written without its newline
                    try:
                        json.loads(raw)
                    except ValueError:
                        self.truncated_tail = True
                        break
                    except RecursionError:
                        pass  # complete but too deep: _parse says so
                line = raw.rstrip(b"\r\n")
                if not line.strip():
                    continue
                self.last_line, self._end = lineno, offset + len(raw)
                if b'"event"' not in line:
                    continue
                entry = self._parse(lineno, line)
                if "event" in entry:
                    k = entry.get("from_step", 0)
                    if type(k) is not int or k < 0:
                        raise TrackerError(
                            f"{self.path}:{lineno}: an event whose from_step is {k!r}, not a "
                            "step number; the log is corrupt"
                        )
                    self.events.append(entry)
                    self._event_lines.append(lineno)
                    self._event_offsets.append(offset)
        # min_after[i]: the smallest from_step of events i, i+1, ...: a record written
        # before event i is effective iff min_after[i] >= its step.
        self._min_after = [0] * (len(self.events) + 1)
        self._min_after[-1] = 1 << 62
        for i in range(len(self.events) - 1, -1, -1):
            self._min_after[i] = min(
                int(self.events[i].get("from_step", 0)), self._min_after[i + 1]
            )

    def _parse(self, lineno: int, line: bytes) -> dict[str, Any]:
        try:
            entry = json.loads(line)
        except ValueError as e:
            raise TrackerError(
                f"{self.path}:{lineno}: not valid JSON ({e}); the log is corrupt"
            ) from None
        except RecursionError:
            raise TrackerError(
                f"{self.path}:{lineno}: JSON nested too deeply to parse; the log is corrupt"
            ) from None
        if not isinstance(entry, dict) or not (
            "event" in entry or ("step" in entry and "chain" in entry)
        ):
            text = line[:120].decode("utf-8", "replace")
            raise TrackerError(f"{self.path}:{lineno}: neither a step record nor an event: {text}")
        return entry

    def event_for(self, step: int) -> dict[str, Any] | None:
        """The start / resume event of the job that wrote the effective record of ``step``."""
        chosen = None
        for e in self.events:
            if int(e.get("from_step", 0)) < step:
                chosen = e
        return chosen

    # -- pass 2: records -------------------------------------------------
    def _problem(self, line: int, step: int | None, kind: str, message: str) -> LogProblem | None:
        """Count a problem; keep it (and return it) while fewer than MAX_PROBLEMS are kept."""
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(LogProblem(line, step, kind, message))
            return self.problems[-1]
        return None

    def records(self) -> Iterator[dict[str, Any]]:
        """Check the whole log and yield its effective records in increasing step order.

        ``problems``, ``notes`` and ``unbound`` are complete once the iterator is
        exhausted (call ``check()`` to only check)."""
        for row in self.rows():
            yield record_of_row(row)

    def rows(self) -> Iterator[tuple]:
        """``records()`` as tuples in ``FIELDS`` order (None for an absent field)."""
        return rows_of_batches(self.batches())

    def _regions(self) -> Iterator[tuple[int, int, bytes, bool]]:
        """(line number, offset, bytes, is an event line) of the log up to the first
        pass's end: runs of whole lines between events, and each event line alone."""
        stops = [*self._event_offsets, self._end]
        lineno, offset = 1, 0
        with open(self.path, "rb") as f:
            for i, stop in enumerate(stops):
                while offset < stop:  # whole lines: an event starts a line, _end ends one
                    size = min(BLOCK_BYTES, stop - offset)
                    f.seek(offset)
                    piece = f.read(size)
                    if len(piece) < size:
                        raise TrackerError(f"{self.path} changed while it was read (it shrank)")
                    if offset + size < stop:
                        cut = piece.rfind(b"\n") + 1
                        if cut == 0:  # a line longer than a block
                            piece += f.readline(stop - offset - size)
                            cut = len(piece)
                        piece = piece[:cut]
                    elif not piece.endswith(b"\n") and b"\n" in piece:
                        piece = piece[: piece.rfind(b"\n") + 1]  # the last line comes alone
                    yield lineno, offset, piece, False
                    lineno += count_lines(piece)
                    offset += len(piece)
                if i < len(self._event_offsets):
                    f.seek(offset)
                    raw = f.readline()
                    lineno = self._event_lines[i]
                    yield lineno, offset, raw, True
                    lineno += 1
                    offset += len(raw)

    def batches(self) -> Iterator[RecordRun | list[tuple]]:
        """``rows()`` in batches: a ``blocks.RecordRun`` for a block of lines the fast
        path accepts, else a list of row tuples."""
        self.problems, self.problem_count, self.notes, self.unbound = [], 0, [], []
        self._wanted = {
            int(e.get("from_step", 0)) for e in self.events if e.get("event") == "resume"
        }
        self._linked: dict[int, str] = {}  # chains of the steps resume events name
        self._prev_chain: str | None = None
        self._prev_step: int | None = None
        self._n_event = 0
        self._order = _Order()
        for lineno0, offset0, piece, is_event in self._regions():
            if self.fast and not is_event and isinstance(self._prev_chain, str):
                runs = check_block(piece, self._prev_step, self._prev_chain)
                if runs is not None:
                    for run in runs:
                        out = self._accept(run, lineno0)
                        lineno0 += len(run)
                        if out is not None:
                            yield out
                    continue
            rows = []
            for lineno, _, raw in self._split(lineno0, offset0, piece):
                line = raw.rstrip(b"\r\n")
                if line.strip():
                    row = self._line(lineno, line)
                    if row is not None:
                        rows.append(row)
            if rows:
                yield rows
        self._order.finish()

    def _accept(self, run: RecordRun, lineno: int) -> RecordRun | None:
        """Note a run the fast path checked (its first line is ``lineno``); its
        effective part (no later event supersedes it) or None."""
        self._order.saw(run.first, run.last, lineno, self._prev_step)
        self._prev_step, self._prev_chain = run.last, run.chains[-32:].hex()
        for s in self._wanted:
            if run.first <= s <= run.last:
                i = s - run.first
                self._linked[s] = run.chains[32 * i : 32 * i + 32].hex()
        keep = min(len(run), self._min_after[self._n_event] - run.first + 1)
        return None if keep <= 0 else run if keep == len(run) else run.head(keep)

    def _line(self, lineno: int, line: bytes) -> tuple | None:
        """Read one line: an event, or a record checked against the one before it;
        the record's row when it is effective."""
        linked, n_event = self._linked, self._n_event
        prev_chain, prev_step = self._prev_chain, self._prev_step
        if n_event < len(self.events) and lineno == self._event_lines[n_event]:
            self._n_event += 1
            self._prev_step, self._prev_chain = self._event(lineno, self.events[n_event], linked)
            return None
        m = RECORD_LINE.fullmatch(line) if prev_chain is not None else None
        if m is not None:  # the writer's layout: chain checked on the bytes
            g = m.groups()
            step = int(g[3])
            if (
                step == prev_step + 1
                and g[5] != b"1"  # format 1 records are "unbound": the general path
                and hashlib.sha256(prev_chain.encode() + line[:-76] + b"}").hexdigest()
                == g[6].decode()
            ):
                self._order.saw(step, step, lineno, prev_step)
                self._prev_step, self._prev_chain = step, g[6].decode()
                if step in self._wanted:
                    linked[step] = self._prev_chain
                if self._min_after[n_event] >= step:
                    return (step, int(g[0]), int(g[2]), g[1].decode(),
                            None if g[4] is None else g[4].decode(), int(g[5]), self._prev_chain)  # fmt: skip
                return None
        fast = chain_of_line(prev_chain, line) if prev_chain is not None else None
        rec = fields_of_line(line) if fast and fast[1] else None
        if rec is None:
            rec = self._parse(lineno, line)
        if "event" in rec:  # an event the first pass missed: the file changed meanwhile
            raise TrackerError(f"{self.path} changed while it was read (line {lineno})")
        try:
            step = int(rec["step"])
            chain = str(rec["chain"])
        except (TypeError, ValueError, OverflowError) as e:
            raise TrackerError(
                f"{self.path}:{lineno}: a field has the wrong type ({e}); the log is corrupt"
            ) from None
        if prev_step is None:
            self._problem(
                lineno, step, "orphan", f"line {lineno}: step {step} before any start event"
            )
        elif step > prev_step + 1:
            self._jump(lineno, prev_step, step)
        elif step <= prev_step:
            self._back(lineno, prev_step, step)
        self._order.saw(step, step, lineno, prev_step)
        if (
            prev_chain is not None
            and not (fast and fast[1])
            and chain_next(prev_chain, rec) != chain
        ):
            self._problem(
                lineno, step, "chain",
                f"line {lineno}: record of step {step}: its chain does not follow from the "
                "record before it (a record was edited, inserted or deleted)",
            )  # fmt: skip
        self._prev_step, self._prev_chain = step, chain
        if step in self._wanted:
            linked[step] = chain
        if self._min_after[n_event] >= step:  # no later event supersedes it
            if rec.get("v", 1) < 2:
                if self.unbound and self.unbound[-1][1] == step - 1:
                    self.unbound[-1][1] = step
                else:
                    self.unbound.append([step, step])
            return tuple(rec.get(k) for k in FIELDS)
        return None

    def _jump(self, lineno: int, prev: int, step: int) -> None:
        """The record of ``step`` follows that of ``prev < step - 1``: the steps between
        are missing, unless all came earlier (the log is out of order)."""
        unseen = self._order.unseen(prev + 1, step - 1)
        if not unseen:
            between = (
                f"step {prev + 1}" if prev + 1 == step - 1 else f"steps {prev + 1}..{step - 1}"
            )
            self._problem(
                lineno, step, "order",
                f"line {lineno}: out of order (step {step} after step {prev}): {between} came "
                "earlier in the log",
            )  # fmt: skip
            return
        gap = unseen[0]  # the first bad step is the first missing one
        what = f"step {gap} is" if gap == step - 1 else f"steps {gap}..{step - 1} are"
        problem = self._problem(
            lineno, gap, "order",
            f"line {lineno}: {what} missing before the record of step {step} (deleted?)",
        )  # fmt: skip
        self._order.skipped(prev + 1, step - 1, _Gap(lineno, step, problem))

    def _back(self, lineno: int, prev: int, step: int) -> None:
        """The record of ``step`` follows that of ``prev >= step``."""
        if not self._order.knows(step):
            message = f"record of step {step} follows step {prev} (repeated or out of order)"
        elif self._order.is_missing(step):
            message = f"out of order (step {step} after step {prev})"
        else:
            message = (
                f"record of step {step} follows step {prev}: step {step} is repeated (its "
                "record came earlier in the log)"
            )
        self._problem(lineno, step, "order", f"line {lineno}: {message}")

    def _event(
        self, lineno: int, e: dict[str, Any], linked: dict[int, str]
    ) -> tuple[int, str | None]:
        k, chain = int(e.get("from_step", 0)), e.get("chain")  # from_step checked by the scan
        self._order.event(e.get("event"), k)
        if chain is not None and not isinstance(chain, str):
            self._problem(
                lineno, None, "event",
                f"line {lineno}: a {e.get('event')} event whose chain is {chain!r}, not a hex "
                "string (the event was edited)",
            )  # fmt: skip
            linked.clear()
            return k, None
        for s in [s for s in linked if s > k]:
            del linked[s]
        if e.get("event") == "start":
            linked.clear()
            fp = e.get("data_config_fingerprint")
            if chain is None:  # tracker format 1: the genesis is not recorded
                self.notes.append(
                    f"line {lineno}: a start event of tracker format 1 (no data config): the "
                    "first record after it cannot be linked"
                )
                return k, None
            if fp is None or fingerprint(e.get("data_config")) != fp or genesis(fp) != chain:
                self._problem(
                    lineno, None, "event",
                    f"line {lineno}: the start event's chain is not the genesis of its data "
                    "config (the event or its data config was edited)",
                )  # fmt: skip
        elif e.get("event") == "resume" and k > 0:
            have = linked.get(k)
            if e.get("chain_restart") or e.get("log_mismatch_ignored"):
                why = "audit was off" if e.get("chain_restart") else "ignore_log_mismatch"
                self.notes.append(
                    f"line {lineno}: resume from step {k} restarted the chain ({why}): steps "
                    f"up to {k} and after it are not linked"
                )
            elif have is None:
                self._problem(
                    lineno, k, "event",
                    f"line {lineno}: resume from step {k}, but the log has no record of step {k} "
                    "before it (records deleted?)",
                )  # fmt: skip
            elif have != chain:
                self._problem(
                    lineno, k, "event",
                    f"line {lineno}: resume from step {k} names chain {str(chain)[:16]}..., the "
                    f"log's record of step {k} has {have[:16]}...",
                )  # fmt: skip
        return k, chain

    def check(self) -> LogReader:
        """Run the integrity check without keeping records."""
        for _ in self.batches():
            pass
        return self


@dataclass
class LogContents:
    """A sequence log resolved to its effective history (materialised: small logs, tools)."""

    path: Path
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Effective step records by step."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Start and resume events in log order."""
    truncated_tail: bool = False
    problems: list[LogProblem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def steps(self) -> list[int]:
        return sorted(self.records)

    def unbound_steps(self) -> list[int]:
        """Effective steps whose records do not bind the data config (tracker format 1)."""
        return [s for s, r in sorted(self.records.items()) if r.get("v", 1) < 2]


def read_log(path: str | os.PathLike) -> LogContents:
    """Parse a whole sequence log, apply its events and check its chain. Raises
    TrackerError on unreadable input; integrity problems are listed in ``problems``."""
    reader = LogReader(path)
    records = {int(r["step"]): r for r in reader.records()}
    return LogContents(
        path=reader.path,
        records=records,
        events=reader.events,
        truncated_tail=reader.truncated_tail,
        problems=reader.problems,
        notes=reader.notes,
    )


def record_of_row(row: tuple) -> dict[str, Any]:
    """A ``FIELDS`` tuple as a record dict (absent fields left out)."""
    rec = dict(zip(FIELDS, row, strict=True))
    if rec["tokens_digest"] is None:
        del rec["tokens_digest"]
    if rec["v"] is None:
        del rec["v"]
    return rec


def rows_of_batches(batches: Iterator[RecordRun | list[tuple]]) -> Iterator[tuple]:
    for batch in batches:
        if isinstance(batch, RecordRun):
            for i in range(len(batch)):
                yield batch.row(i)
        else:
            yield from batch


# ---------------------------------------------------------------- in another process

_BLOCK = 4096


def _serve(path: str, conn: Any) -> None:
    """Child process: stream a log's effective records to ``conn`` in batches
    (``RecordRun`` columns, or lists of row tuples), then one summary dict (or an
    error string)."""
    try:
        reader = LogReader(path)
        conn.send(("events", reader.events, reader.truncated_tail))
        rows: list[tuple] = []
        for batch in reader.batches():
            if isinstance(batch, RecordRun):
                if rows:
                    conn.send(("batch", rows))
                    rows = []
                conn.send(("batch", batch))
                continue
            rows += batch
            if len(rows) >= _BLOCK:
                conn.send(("batch", rows))
                rows = []
        if rows:
            conn.send(("batch", rows))
        conn.send(
            (
                "done",
                {
                    "problems": reader.problems,
                    "problem_count": reader.problem_count,
                    "notes": reader.notes,
                    "unbound": reader.unbound,
                },
            )
        )
    except (TrackerError, OSError) as e:
        conn.send(("error", str(e)))
    except Exception as e:  # noqa: BLE001 - the child reports, the parent raises TrackerError
        conn.send(
            ("error", f"{path}: the sequence log could not be read ({type(e).__name__}: {e})")
        )
    finally:
        conn.close()


class ForkedLogReader:
    """A ``LogReader`` whose work runs in a child process (records streamed back in
    batches through a pipe: memory stays bounded), so two logs are checked on two
    cores at once. Same attributes as ``LogReader`` once ``batches()`` is exhausted."""

    def __init__(self, path: str | os.PathLike) -> None:
        import multiprocessing as mp

        self.path = resolve(path)
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve, args=(str(self.path), child), daemon=True)
        self._proc.start()
        child.close()
        self.problems: list[LogProblem] = []
        self.problem_count = 0
        self.notes: list[str] = []
        self.unbound: list[list[int]] = []
        kind, *rest = self._recv()
        self.events, self.truncated_tail = rest

    def _recv(self) -> tuple:
        try:
            msg = self._conn.recv()
        except EOFError:
            raise TrackerError(f"reading {self.path} failed (the reader process died)") from None
        if msg[0] == "error":
            raise TrackerError(msg[1])
        return msg

    def batches(self) -> Iterator[RecordRun | list[tuple]]:
        try:
            while True:
                kind, payload = self._recv()
                if kind == "done":
                    self.__dict__.update(payload)
                    return
                yield payload
        finally:
            self._conn.close()
            self._proc.join()

    def rows(self) -> Iterator[tuple]:
        return rows_of_batches(self.batches())

    def records(self) -> Iterator[dict[str, Any]]:
        for row in self.rows():
            yield record_of_row(row)

    event_for = LogReader.event_for
