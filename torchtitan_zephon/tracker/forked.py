"""A ``LogReader`` in a child process, so two logs are checked on two cores at once.

Role: ``zephon verify A B`` reads each large log in its own process
(``runs.log_reader(forked=True)``); the child runs ``LogReader.batches()`` and
sends the batches back through a pipe, then the reader's problems and notes.

Invariant: a ``ForkedLogReader`` gives the same events, batches, problems, notes
and errors as a ``LogReader`` of the same log (memory stays bounded: batches are
streamed, never collected); any failure in the child is a TrackerError in the
parent.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from torchtitan_zephon.tracker.fast_path import RecordRun
from torchtitan_zephon.tracker.reader import (
    LogReader,
    record_of_row,
    resolve,
    rows_of_batches,
)
from torchtitan_zephon.tracker.records import LogProblem, TrackerError

_BATCH_ROWS = 4096


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
            if len(rows) >= _BATCH_ROWS:
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
