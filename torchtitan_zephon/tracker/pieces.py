"""A sequence log's bytes in pieces of whole lines: what both of the reader's passes walk.

Role: ``LogReader`` reads a log a few MB at a time (``reader.BLOCK_BYTES``, given
here as ``block``); these generators cut the file into pieces that never split a
line, number the lines and find the event lines cheaply.

Invariant: the pieces cover the bytes read exactly once, in file order, each
ending at a newline (except the file's last line written without one, which
comes alone); line numbers and offsets are those of the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from torchtitan_zephon.tracker.records import TrackerError


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


def pieces(path: Path, block: int) -> Iterator[tuple[int, int, bytes, int]]:
    """(line number, byte offset, bytes, newlines) of the log in pieces of whole
    lines, about ``block`` bytes each; a last line without its newline comes as a piece of its own."""
    with open(path, "rb") as f:
        lineno, offset = 1, 0
        while piece := f.read(block):
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


def split_lines(lineno: int, offset: int, piece: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(line number, offset, raw line with its newline) of each line of a piece."""
    at = 0
    while at < len(piece):
        nl = piece.find(b"\n", at) + 1 or len(piece)
        yield lineno, offset + at, piece[at:nl]
        lineno += 1
        at = nl


def regions(
    path: Path, block: int, event_lines: list[int], event_offsets: list[int], end: int
) -> Iterator[tuple[int, int, bytes, bool]]:
    """(line number, offset, bytes, is an event line) of the log up to ``end`` (where
    the first pass stopped): runs of whole lines between the events (lines
    ``event_lines`` at ``event_offsets``), and each event line alone."""
    stops = [*event_offsets, end]
    lineno, offset = 1, 0
    with open(path, "rb") as f:
        for i, stop in enumerate(stops):
            while offset < stop:  # whole lines: an event starts a line, end ends one
                size = min(block, stop - offset)
                f.seek(offset)
                piece = f.read(size)
                if len(piece) < size:
                    raise TrackerError(f"{path} changed while it was read (it shrank)")
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
            if i < len(event_offsets):
                f.seek(offset)
                raw = f.readline()
                lineno = event_lines[i]
                yield lineno, offset, raw, True
                lineno += 1
                offset += len(raw)
