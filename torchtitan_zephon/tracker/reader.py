"""Reading a sequence log: effective history and integrity, streamed.

A log is read in two passes over its lines. The first parses only the start /
resume events (a few per job). The second streams the step records in file
order, recomputes each chain from the one before it, checks step order and
event links, and yields the records of the *effective history* (those no later
event supersedes) in increasing step order.

Invariants:
- Memory is bounded by the number of events, never by the number of steps:
  ``LogReader.records()`` yields; only ``read_log`` materialises a dict.
- Every record's chain is recomputed (``records.chain_of_line`` on the line's
  bytes, or from the parsed body for lines of older layouts); the first record
  whose chain, step order or resume link is wrong is reported with its line and
  step. A deleted, inserted, reordered or edited record never goes unnoticed.
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

from torchtitan_zephon.data.digest import fingerprint
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


class LogReader:
    """One sequence log, read lazily: events up front, records streamed."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = resolve(path)
        self.events: list[dict[str, Any]] = []
        """Start and resume events in log order."""
        self._event_lines: list[int] = []
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
        self._scan_events()

    # -- pass 1: events --------------------------------------------------
    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, line without newline) of every non-blank line but a cut last one."""
        with open(self.path, "rb") as f:
            lineno = 0
            for raw in f:
                lineno += 1
                if not raw.endswith(b"\n"):  # the last line, written without its newline
                    try:
                        json.loads(raw)
                    except ValueError:
                        self.truncated_tail = True
                        return
                line = raw.rstrip(b"\r\n")
                if line.strip():
                    yield lineno, line

    def _scan_events(self) -> None:
        for lineno, line in self._lines():
            self.last_line = lineno
            if b'"event"' not in line:
                continue
            entry = self._parse(lineno, line)
            if "event" in entry:
                k = entry.get("from_step", 0)
                if type(k) is not int or k < 0:
                    raise TrackerError(
                        f"{self.path}:{lineno}: an event whose from_step is {k!r}, not a step "
                        "number; the log is corrupt"
                    )
                self.events.append(entry)
                self._event_lines.append(lineno)
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
    def _problem(self, line: int, step: int | None, kind: str, message: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(LogProblem(line, step, kind, message))

    def records(self) -> Iterator[dict[str, Any]]:
        """Check the whole log and yield its effective records in increasing step order.

        ``problems``, ``notes`` and ``unbound`` are complete once the iterator is
        exhausted (call ``check()`` to only check)."""
        for row in self.rows():
            rec = dict(zip(FIELDS, row, strict=True))
            if rec["tokens_digest"] is None:
                del rec["tokens_digest"]
            if rec["v"] is None:
                del rec["v"]
            yield rec

    def rows(self) -> Iterator[tuple]:
        """``records()`` as tuples in ``FIELDS`` order (None for an absent field): the
        fast path for lines in the writer's layout builds no dict."""
        self.problems, self.problem_count, self.notes, self.unbound = [], 0, [], []
        sha256 = hashlib.sha256
        match = RECORD_LINE.fullmatch
        wanted = {int(e.get("from_step", 0)) for e in self.events if e.get("event") == "resume"}
        linked: dict[int, str] = {}  # chains of the steps resume events name
        prev_chain: str | None = None
        prev_step: int | None = None
        n_event = 0
        for lineno, line in self._lines():
            if lineno > self.last_line:  # appended after the first pass: not part of this read
                break
            if n_event < len(self.events) and lineno == self._event_lines[n_event]:
                e = self.events[n_event]
                n_event += 1
                prev_step, prev_chain = self._event(lineno, e, linked)
                continue
            m = match(line) if prev_chain is not None else None
            if m is not None:  # the writer's layout: chain checked on the bytes
                g = m.groups()
                step = int(g[3])
                if (
                    step == prev_step + 1
                    and g[5] != b"1"  # format 1 records are "unbound": the general path
                    and sha256(prev_chain.encode() + line[:-76] + b"}").hexdigest() == g[6].decode()
                ):
                    prev_step, prev_chain = step, g[6].decode()
                    if step in wanted:
                        linked[step] = prev_chain
                    if self._min_after[n_event] >= step:
                        yield (step, int(g[0]), int(g[2]), g[1].decode(),
                               None if g[4] is None else g[4].decode(), int(g[5]), prev_chain)  # fmt: skip
                    continue
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
            elif step > prev_step + 1:  # the first bad step is the first missing one
                gap = prev_step + 1
                what = f"step {gap} is" if gap == step - 1 else f"steps {gap}..{step - 1} are"
                self._problem(
                    lineno, gap, "order",
                    f"line {lineno}: {what} missing before the record of step {step} (deleted?)",
                )  # fmt: skip
            elif step <= prev_step:
                self._problem(
                    lineno, step, "order",
                    f"line {lineno}: record of step {step} follows step {prev_step} "
                    "(repeated or out of order)",
                )  # fmt: skip
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
            prev_step, prev_chain = step, chain
            if step in wanted:
                linked[step] = chain
            if self._min_after[n_event] >= step:  # no later event supersedes it
                if rec.get("v", 1) < 2:
                    if self.unbound and self.unbound[-1][1] == step - 1:
                        self.unbound[-1][1] = step
                    else:
                        self.unbound.append([step, step])
                yield tuple(rec.get(k) for k in FIELDS)

    def _event(
        self, lineno: int, e: dict[str, Any], linked: dict[int, str]
    ) -> tuple[int, str | None]:
        k = int(e.get("from_step", 0))
        for s in [s for s in linked if s > k]:
            del linked[s]
        chain = e.get("chain")
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
        for _ in self.records():
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


# ---------------------------------------------------------------- in another process

_BLOCK = 4096


def _serve(path: str, conn: Any) -> None:
    """Child process: stream a log's effective records to ``conn`` in blocks of tuples,
    then one summary dict (or an error string)."""
    try:
        reader = LogReader(path)
        conn.send(("events", reader.events, reader.truncated_tail))
        block: list[tuple] = []
        for row in reader.rows():
            block.append(row)
            if len(block) == _BLOCK:
                conn.send(("records", block))
                block = []
        if block:
            conn.send(("records", block))
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
    blocks through a pipe: memory stays bounded), so two logs are checked on two
    cores at once. Same attributes as ``LogReader`` once ``records()`` is exhausted."""

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

    def records(self) -> Iterator[dict[str, Any]]:
        try:
            while True:
                kind, payload = self._recv()
                if kind == "done":
                    self.__dict__.update(payload)
                    return
                for values in payload:
                    rec = dict(zip(FIELDS, values, strict=True))
                    if rec["tokens_digest"] is None:
                        del rec["tokens_digest"]
                    if rec["v"] is None:
                        del rec["v"]
                    yield rec
        finally:
            self._conn.close()
            self._proc.join()

    event_for = LogReader.event_for
