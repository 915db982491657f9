"""Reading a sequence log: effective history and integrity, streamed.

A log is read in two passes, a few MB at a time (``STRETCH_BYTES``). The first
parses only the events (start, resume, skip: a few per job). The second streams the
step records in file order, recomputes each chain from the one before it, checks
step order and event links, and yields the records of the *effective history*
(those no later event supersedes) in increasing step order. A stretch of record
lines in the writer's layout is checked at once (``fast_path.check_stretch``: one
sha256 per line, the rest column-wise) and comes out as a ``RecordRun``; any
stretch it does not accept is read line by line, as with ``fast=False``.

Beside it: ``stretches`` (the bytes in stretches of whole lines), ``step_order`` (missing,
out-of-order and repeated steps), ``links`` (how events link to records), ``forked``
(the same reading in a child process).

Invariants:
- Memory is bounded by the number of events, the stretch size and MAX_GAPS, never
  by the number of steps: ``LogReader.batches()`` yields; only ``read_log``
  materialises a dict.
- The stretch fast path changes nothing but speed: ``batches()`` gives the same
  rows, problems, notes and errors with ``fast=True`` and ``fast=False``
  (tests/test_tracker_fast_path.py tampers with logs to try to break this).
- Every record's chain is recomputed (``records.chain_of_line`` on the line's
  bytes, or from the parsed body for lines of older layouts); the first record
  whose chain, step order or resume link is wrong is reported with its line and
  step. A deleted, inserted, reordered or edited record never goes unnoticed.
  A step-order problem says which it is: a step missing (its record never comes),
  out of order (its record comes further on: ``step_order.StepOrder`` follows the
  skipped steps), or repeated.
- A truncated last line (a crash mid-write) is tolerated and reported; an
  unparsable line anywhere else is a TrackerError naming the line.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_zephon.tracker.fast_path import RecordRun, check_stretch
from torchtitan_zephon.tracker.links import ANNOTATIONS, check_annotation, check_event
from torchtitan_zephon.tracker.records import (
    LOG_NAME,
    RECORD_LINE,
    LogProblem,
    TrackerError,
    chain_next,
    chain_of_line,
    fields_of_line,
    log_path,
)
from torchtitan_zephon.tracker.step_order import StepOrder
from torchtitan_zephon.tracker.stretches import has_event, regions, split_lines, stretches

FIELDS = ("step", "first_position", "num_samples", "ids_digest", "tokens_digest", "v", "chain")
"""A record's fields in the order ``LogReader.rows()`` gives them."""
MAX_PROBLEMS = 100
"""Problems kept in detail; the rest are counted."""


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


STRETCH_BYTES = 4 << 20
"""How much of the log the reader takes at once (whole lines; at least one line)."""


class LogReader:
    """One sequence log, read lazily: events up front, records streamed.

    ``fast=False`` reads every line on its own (the reference the stretch fast path
    of ``fast_path.check_stretch`` is tested against)."""

    def __init__(self, path: str | os.PathLike, *, fast: bool = True) -> None:
        self.path = resolve(path)
        self.fast = fast
        self.events: list[dict[str, Any]] = []
        """Start and resume events and annotations (skip, quorum, retry) in log order."""
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
    def _scan_events(self) -> None:
        for lineno0, offset0, stretch, newlines in stretches(self.path, STRETCH_BYTES):
            if stretch.endswith(b"\n") and not has_event(stretch):
                text = stretch.rstrip()  # the last non-blank line is the last one to read
                if text:
                    self.last_line = lineno0 + newlines - stretch.count(b"\n", len(text))
                    self._end = offset0 + stretch.index(b"\n", len(text)) + 1
                continue
            for lineno, offset, raw in split_lines(lineno0, offset0, stretch):
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
            if e.get("event") not in ANNOTATIONS and int(e.get("from_step", 0)) < step:
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

    def batches(self) -> Iterator[RecordRun | list[tuple]]:
        """``rows()`` in batches: a ``fast_path.RecordRun`` for a stretch of lines the fast
        path accepts, else a list of row tuples."""
        self.problems, self.problem_count, self.notes, self.unbound = [], 0, [], []
        self._wanted = {
            int(e.get("from_step", 0)) for e in self.events if e.get("event") == "resume"
        }
        self._linked: dict[int, str] = {}  # chains of the steps resume events name
        self._prev_chain: str | None = None
        self._prev_step: int | None = None
        self._n_event = 0
        self._order = StepOrder()
        for lineno0, offset0, stretch, is_event in regions(
            self.path, STRETCH_BYTES, self._event_lines, self._event_offsets, self._end
        ):
            if self.fast and not is_event and isinstance(self._prev_chain, str):
                runs = check_stretch(stretch, self._prev_step, self._prev_chain)
                if runs is not None:
                    for run in runs:
                        out = self._accept(run, lineno0)
                        lineno0 += len(run)
                        if out is not None:
                            yield out
                    continue
            rows = []
            for lineno, _, raw in split_lines(lineno0, offset0, stretch):
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
            event = self.events[n_event]
            if event.get("event") in ANNOTATIONS:  # the chain goes on through it
                check_annotation(lineno, event, (prev_step, prev_chain), self._problem)
                return None
            self._order.event(event.get("event"), int(event.get("from_step", 0)))
            self._prev_step, self._prev_chain = check_event(
                lineno, event, linked, self._problem, self.notes
            )
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
            self._order.jump(lineno, prev_step, step, self._problem)
        elif step <= prev_step:
            self._order.back(lineno, prev_step, step, self._problem)
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
