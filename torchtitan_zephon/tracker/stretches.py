"""A sequence log's bytes in stretches of whole lines: what both of the reader's passes walk.

Role: ``LogReader`` reads a log a few MB at a time (``reader.STRETCH_BYTES``, given
here as ``size``); these generators cut the file into stretches that never split a
line, number the lines and find the event lines cheaply.

Invariant: the stretches cover the bytes read exactly once, in file order, each
ending at a newline (except the file's last line written without one, which
comes alone); line numbers and offsets are those of the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from torchtitan_zephon.tracker.records import TrackerError


def count_lines(stretch: bytes) -> int:
    """Newlines in ``stretch`` (numpy counts several times faster than bytes.count)."""
    return int(np.count_nonzero(np.frombuffer(stretch, dtype=np.uint8) == 10))


def has_event(stretch: bytes) -> bool:
    """``b'"event"' in stretch``, found from the few places a ``v`` is (one per record)."""
    buf = np.frombuffer(stretch, dtype=np.uint8)
    v = np.flatnonzero(buf == ord("v"))
    v = v[(v >= 2) & (v + 5 <= len(buf))]
    return bool(
        (
            (buf[v - 2] == ord('"')) & (buf[v - 1] == ord("e")) & (buf[v + 1] == ord("e"))
            & (buf[v + 2] == ord("n")) & (buf[v + 3] == ord("t")) & (buf[v + 4] == ord('"'))
        ).any()
    )  # fmt: skip


def stretches(path: Path, size: int) -> Iterator[tuple[int, int, bytes, int]]:
    """(line number, byte offset, bytes, newlines) of the log in stretches of whole
    lines, about ``size`` bytes each; a last line without its newline comes as a stretch
    of its own."""
    with open(path, "rb") as f:
        lineno, offset = 1, 0
        while stretch := f.read(size):
            if not stretch.endswith(b"\n"):
                stretch += f.readline()
                cut = stretch.rfind(b"\n") + 1
                if 0 < cut < len(stretch):  # the file's last line, without its newline
                    head, stretch = stretch[:cut], stretch[cut:]
                    newlines = count_lines(head)
                    yield lineno, offset, head, newlines
                    lineno, offset = lineno + newlines, offset + cut
            newlines = count_lines(stretch)
            yield lineno, offset, stretch, newlines
            lineno, offset = lineno + newlines, offset + len(stretch)


def split_lines(lineno: int, offset: int, stretch: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(line number, offset, raw line with its newline) of each line of a stretch."""
    at = 0
    while at < len(stretch):
        nl = stretch.find(b"\n", at) + 1 or len(stretch)
        yield lineno, offset + at, stretch[at:nl]
        lineno += 1
        at = nl


def regions(
    path: Path, size: int, event_lines: list[int], event_offsets: list[int], end: int
) -> Iterator[tuple[int, int, bytes, bool]]:
    """(line number, offset, bytes, is an event line) of the log up to ``end`` (where
    the first pass stopped): runs of whole lines between the events (lines
    ``event_lines`` at ``event_offsets``), and each event line alone."""
    stops = [*event_offsets, end]
    lineno, offset = 1, 0
    with open(path, "rb") as f:
        for i, stop in enumerate(stops):
            while offset < stop:  # whole lines: an event starts a line, end ends one
                want = min(size, stop - offset)
                f.seek(offset)
                stretch = f.read(want)
                if len(stretch) < want:
                    raise TrackerError(f"{path} changed while it was read (it shrank)")
                if offset + want < stop:
                    cut = stretch.rfind(b"\n") + 1
                    if cut == 0:  # a line longer than a stretch
                        stretch += f.readline(stop - offset - want)
                        cut = len(stretch)
                    stretch = stretch[:cut]
                elif not stretch.endswith(b"\n") and b"\n" in stretch:
                    stretch = stretch[: stretch.rfind(b"\n") + 1]  # the last line comes alone
                yield lineno, offset, stretch, False
                lineno += count_lines(stretch)
                offset += len(stretch)
            if i < len(event_offsets):
                f.seek(offset)
                raw = f.readline()
                lineno = event_lines[i]
                yield lineno, offset, raw, True
                lineno += 1
                offset += len(raw)
