"""Checking a stretch of step records at once: the reader's fast path.

A stretch is a run of whole log lines (each ending in a newline) with no event
among them. ``check_stretch`` accepts it only when every line is a record in the
writer's layout (``records.RECORD_LINE`` with ``"v":2``), the steps follow one
another from the step before the stretch, and every chain follows from the one
before it; it then returns the records as ``RecordRun`` columns (raw digests,
numpy integers) instead of one tuple per line. Lines of equal length are viewed
as one 2-D byte array and checked column by column against a template taken from
the run's first line; only the chain's sha256 is computed line by line.

Invariant: ``check_stretch`` returns runs only where the per-line reading
(``LogReader`` with the fast path off) would take every line of the stretch through
its writer's-layout path, with no problem, and yield exactly the rows
``RecordRun.row`` gives; in every other case it returns None and changes
nothing, so the caller reads the stretch line by line and reports what it finds.
"""

from __future__ import annotations

import binascii
import hashlib
from dataclasses import dataclass

import numpy as np

from torchtitan_zephon.tracker.records import RECORD_LINE

_TAIL = 76
"""``,"chain":"<64 hex>"}``: what follows a record's body in its line."""
_MAX_DIGITS = 18
"""Integer fields wider than this may not fit int64: such lines take the slow path."""
_NL = 10


@dataclass
class RecordRun:
    """Consecutive step records ``first, first + 1, ...`` of format 2 (``"v": 2``),
    as columns: 32 raw bytes per digest, int64 positions and sample counts."""

    first: int
    first_positions: np.ndarray
    num_samples: np.ndarray
    ids: bytes
    tokens: bytes | None
    chains: bytes

    def __len__(self) -> int:
        return len(self.first_positions)

    @property
    def last(self) -> int:
        return self.first + len(self) - 1

    def row(self, i: int) -> tuple:
        """Record ``i`` as a ``reader.FIELDS`` tuple (hex digests, Python ints)."""
        a, b = 32 * i, 32 * i + 32
        return (
            self.first + i,
            int(self.first_positions[i]),
            int(self.num_samples[i]),
            self.ids[a:b].hex(),
            None if self.tokens is None else self.tokens[a:b].hex(),
            2,
            self.chains[a:b].hex(),
        )

    def head(self, n: int) -> RecordRun:
        """The first ``n`` records."""
        return RecordRun(
            self.first,
            self.first_positions[:n],
            self.num_samples[:n],
            self.ids[: 32 * n],
            None if self.tokens is None else self.tokens[: 32 * n],
            self.chains[: 32 * n],
        )


@dataclass(frozen=True)
class _Template:
    """Where a line of one length keeps each field (column spans), and its literal bytes."""

    digits: tuple[tuple[int, int], ...]  # first_position, num_samples, step
    hexes: tuple[tuple[int, int], ...]  # ids, chain, [tokens]
    row: np.ndarray  # the line the template was taken from, newline included
    literal: np.ndarray  # 0xFF where the row's byte is literal, 0 in a field

    @staticmethod
    def of(line: bytes) -> _Template | None:
        m = RECORD_LINE.fullmatch(line)
        if m is None or m.group(6) != b"2":
            return None
        digits = (m.span(1), m.span(3), m.span(4))
        if any(e - s > _MAX_DIGITS for s, e in digits):
            return None
        hexes = (m.span(2), m.span(7)) + ((m.span(5),) if m.group(5) is not None else ())
        literal = np.full(len(line) + 1, 0xFF, dtype=np.uint8)
        for s, e in digits + hexes:
            literal[s:e] = 0
        return _Template(digits, hexes, np.frombuffer(line + b"\n", dtype=np.uint8), literal)


_HEX_CHARS = b"0123456789abcdef"


def _decimal(cols: np.ndarray) -> np.ndarray:
    """int64 values of rows of ASCII digits."""
    v = cols[:, 0].astype(np.int64) - 48
    for j in range(1, cols.shape[1]):
        v = v * 10 + (cols[:, j] - 48)
    return v


def _hex(cols: np.ndarray) -> bytes | None:
    """Raw bytes of rows of lowercase hex digits; None if any is not one."""
    text = cols.tobytes()
    return None if text.translate(None, _HEX_CHARS) else binascii.unhexlify(text)


def _check_run(a: np.ndarray, t: _Template, prev_step: int, prev_chain: bytes) -> RecordRun | None:
    """Lines ``a`` (k x (length + 1) bytes, newline last) against template ``t``."""
    k, n = a.shape[0], a.shape[1] - 1
    scratch = np.bitwise_xor(a, t.row)
    if np.bitwise_and(scratch, t.literal, out=scratch).any():
        return None
    for s, e in t.digits:
        if not (np.subtract(a[:, s:e], np.uint8(48)) < 10).all():
            return None
    digests = [_hex(a[:, s:e]) for s, e in t.hexes]
    if any(d is None for d in digests):
        return None
    (fs, fe), (ns, ne), (ss, se) = t.digits
    steps = _decimal(a[:, ss:se])
    if steps[0] != prev_step + 1 or (k > 1 and not (np.diff(steps) == 1).all()):
        return None
    # sha256(previous chain + body + "}") of each line, the inputs laid side by side
    body = n - _TAIL
    width = 64 + body + 1
    cs, ce = t.hexes[1]
    inputs = np.empty((k, width), dtype=np.uint8)
    inputs[0, :64] = np.frombuffer(prev_chain, dtype=np.uint8)
    inputs[1:, :64] = a[:-1, cs:ce]
    inputs[:, 64 : 64 + body] = a[:, :body]
    inputs[:, -1] = ord("}")
    buf = inputs.tobytes()
    sha256 = hashlib.sha256
    chains = b"".join([sha256(buf[i : i + width]).digest() for i in range(0, k * width, width)])
    if chains != digests[1]:
        return None
    return RecordRun(
        int(steps[0]),
        _decimal(a[:, fs:fe]),
        _decimal(a[:, ns:ne]),
        digests[0],
        digests[2] if len(digests) == 3 else None,
        chains,
    )


def check_stretch(stretch: bytes, prev_step: int, prev_chain: str) -> list[RecordRun] | None:
    """The records of ``stretch`` (whole lines, no event) following ``prev_step`` and
    ``prev_chain``, or None when any line needs the per-line reading."""
    prev = prev_chain.encode()
    if not stretch.endswith(b"\n") or len(prev) != 64 or not 0 <= prev_step < 1 << 62:
        return None
    buf = np.frombuffer(stretch, dtype=np.uint8)
    ends = np.flatnonzero(buf == _NL)
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts
    cuts = np.flatnonzero(np.diff(lengths)) + 1
    runs: list[RecordRun] = []
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(ends)], strict=True):
        start, n = int(starts[lo]), int(lengths[lo])
        if n <= _TAIL:
            return None
        t = _Template.of(stretch[start : start + n])
        if t is None:
            return None
        a = buf[start : start + (hi - lo) * (n + 1)].reshape(hi - lo, n + 1)
        run = _check_run(a, t, prev_step, prev)
        if run is None:
            return None
        runs.append(run)
        prev_step, prev = run.last, run.chains[-32:].hex().encode()
    return runs
