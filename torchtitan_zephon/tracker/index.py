"""The sequence log's sidecar index: find a step's newest record in O(1).

``<log>.idx`` holds one 16-byte slot per step at byte ``16 * step``: the byte
offset of the newest record of that step in the log (u64), the line's length
(u32) and a magic number (u32). ``<log>.events`` holds one line per start /
resume event: ``offset from_step``.

Invariant: the index is a cache, never a source of truth. Every lookup is
checked against the log itself (the slot must point at a record line of that
step); a missing, stale or foreign index only makes the lookup fall back to a
full read of the log, which then rewrites the index. The log is written before
its index entry, so a crash between the two leaves an entry missing, never one
that points past the log.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

_SLOT = struct.Struct("<QII")
_MAGIC = 0x5A455048  # "ZEPH"


def index_path(log: Path) -> Path:
    return log.with_name(log.name + ".idx")


def events_path(log: Path) -> Path:
    return log.with_name(log.name + ".events")


class LogIndex:
    """Append-side and lookup-side access to one log's sidecar files."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def note_record(self, step: int, offset: int, length: int) -> None:
        fd = os.open(index_path(self.log), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, _SLOT.pack(offset, length, _MAGIC), _SLOT.size * step)
        finally:
            os.close(fd)

    def note_event(self, offset: int, from_step: int) -> None:
        with open(events_path(self.log), "a", encoding="ascii") as f:
            f.write(f"{offset} {from_step}\n")

    def reset(self) -> None:
        """Forget everything (before a rebuild from a full read)."""
        for p in (index_path(self.log), events_path(self.log)):
            p.unlink(missing_ok=True)

    def record(self, step: int) -> tuple[int, bytes] | None:
        """(offset, line) of the newest record of ``step`` per the index, or None."""
        try:
            with open(index_path(self.log), "rb") as f:
                f.seek(_SLOT.size * step)
                slot = f.read(_SLOT.size)
        except OSError:
            return None
        if len(slot) != _SLOT.size:
            return None
        offset, length, magic = _SLOT.unpack(slot)
        if magic != _MAGIC or length == 0:
            return None
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                line = f.read(length + 1)
        except OSError:
            return None
        if len(line) != length + 1 or not line.endswith(b"\n"):
            return None
        try:
            rec = json.loads(line)
        except ValueError:
            return None
        if not isinstance(rec, dict) or rec.get("step") != step or "event" in rec:
            return None
        return offset, line[:-1]

    def superseded_after(self, offset: int, step: int) -> bool | None:
        """Whether an event written after ``offset`` supersedes ``step`` (from_step <
        step); None when the events file is missing or does not match the log."""
        try:
            lines = events_path(self.log).read_text(encoding="ascii").split()
            size = self.log.stat().st_size
        except OSError:
            return None
        if len(lines) % 2:
            return None
        superseded = False
        with open(self.log, "rb") as f:
            for i in range(0, len(lines), 2):
                try:
                    ev_offset, from_step = int(lines[i]), int(lines[i + 1])
                except ValueError:
                    return None
                if ev_offset >= size:
                    return None
                f.seek(ev_offset)
                head = f.readline(1 << 16)
                if b'"event"' not in head:
                    return None  # stale: the offset no longer starts an event line
                if ev_offset > offset and from_step < step:
                    superseded = True
        return superseded
