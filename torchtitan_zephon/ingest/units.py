"""Work units of a prepare: the pieces of the inputs that processes tokenize apart.

Role: cut the sources (``inputs.py``) into units, in input order, by the inputs
alone: a plain JSON lines file into byte ranges of about ``UNIT_BYTES`` at line
starts (boundary ``k`` is the first line start at or after ``k * unit_bytes``,
found by reading a little near it), a Parquet file into runs of row groups of
about ``UNIT_BYTES`` on disk, anything else (gzip JSON lines, JSON, a text file
that is one document, a Hugging Face dataset folder, an object in object storage:
it is cut before it is fetched) one unit per source. Also:
the identity of the inputs (names, kinds, sizes, modification times) that every
rank of a distributed prepare must agree on, and the hash of the input bytes a
unit reads, which tells whether a finished tokenized unit still matches its input.

Invariant: the units never depend on the number of processes, and the documents
of a source's units, concatenated in unit order, are exactly the source's
documents (``readers.iter_documents`` with and without ``extent``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from torchtitan_zephon.ingest.inputs import InputFile
from torchtitan_zephon.ingest.json_readers import is_line_start
from torchtitan_zephon.ingest.readers import parquet_row_groups

UNIT_BYTES = 64 << 20
"""Target input bytes per unit: enough work (seconds of tokenizing) to amortise a tokenized unit's
files and record, small enough that one huge file spreads over many processes."""

_SCAN = 1 << 16  # bytes read at a time when looking for a line start


@dataclass(frozen=True)
class Unit:
    """Unit ``index`` (in input order): source ``source``, its ``extent`` (a range for
    ``iter_documents``; None for the whole source) and the input bytes ``span`` it reads
    (hashed to tell whether a finished tokenized unit still matches its input)."""

    index: int
    source: int
    extent: tuple[int, int] | None
    span: tuple[int, int]
    size: int  # bytes of input: the work, for assigning units to ranks

    def describe(self, src: InputFile) -> dict[str, Any]:
        """What the unit is, in a tokenized unit's record: source name and kind, extent (kept as ``part``, so earlier records still match), span (and the
        splits read, for a DatasetDict)."""
        described: dict[str, Any] = {
            "source": src.name,
            "kind": src.kind,
            "part": None if self.extent is None else list(self.extent),
            "span": list(self.span),
        }
        if src.splits is not None:
            described["splits"] = list(src.splits)
        return described


def _files(src: InputFile) -> list[Path]:
    if src.path.is_dir():
        return sorted((p for p in src.path.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    return [src.path]


def source_stat(src: InputFile) -> tuple[int, int]:
    """(size in bytes, latest modification time in ns) of a source's file(s); of an
    object in object storage, its listing's (its spool file is written once, whole)."""
    if src.remote is not None:
        return src.remote.size, src.remote.mtime_ns
    size = mtime = 0
    for f in _files(src):
        st = f.stat()
        size += st.st_size
        mtime = max(mtime, st.st_mtime_ns)
    return size, mtime


def jsonl_boundaries(path: Path, size: int, unit_bytes: int) -> list[int]:
    """Line starts cutting a plain JSON lines file of ``size`` bytes into ranges: 0, then
    for each ``k >= 1`` the first line start at or after ``k * unit_bytes`` (duplicates
    dropped), then ``size``. Reads only near the boundaries (all of a file without line
    breaks, once)."""
    cuts = [0]
    with open(path, "rb") as fh:
        for k in range(1, -(-size // unit_bytes)):
            p = max(k * unit_bytes, cuts[-1] + 1)
            if p >= size:
                break
            p = _line_start_at_or_after(fh, p, size)
            if p >= size:
                break
            if p > cuts[-1]:
                cuts.append(p)
    cuts.append(size)
    return cuts


def _line_start_at_or_after(fh: Any, p: int, size: int) -> int:
    """The first line start at or after byte ``p`` (0 < p < size), or ``size``."""
    while p < size:
        fh.seek(p - 1)
        block = fh.read(_SCAN + 1)  # bytes p-1 ..: a line start q needs bytes q-1 and q
        j, end = 0, len(block) - 1
        while True:
            found = [x for x in (block.find(b"\n", j, end), block.find(b"\r", j, end)) if x >= 0]
            if not found:
                break
            x = min(found)  # a line break at byte p-1+x: maybe a line starts after it
            if is_line_start(block, x + 1):
                return p + x
            j = x + 1
        p += end
    return size


def cut_units(sources: list[InputFile], unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of ``sources``, in input order (see the module docstring)."""
    if unit_bytes < 1:
        raise ValueError(f"unit_bytes must be >= 1, got {unit_bytes}.")
    units: list[Unit] = []

    def add(source: int, extent: tuple[int, int] | None, span: tuple[int, int], size: int) -> None:
        units.append(Unit(len(units), source, extent, span, size))

    for s, src in enumerate(sources):
        size = source_stat(src)[0]
        if src.remote is not None:  # one unit: cut without reading it (it is fetched then)
            add(s, None, (0, size), size)
        elif src.kind == "jsonl" and not src.path.name.lower().endswith(".gz") and size:
            cuts = jsonl_boundaries(src.path, size, unit_bytes)
            for a, b in zip(cuts, cuts[1:], strict=False):
                add(s, (a, b), (a, b), b - a)
        elif src.kind == "parquet" and (runs := _row_group_runs(src.path, size, unit_bytes)):
            for first, stop, span in runs:
                add(s, (first, stop), span, span[1] - span[0])
        else:
            add(s, None, (0, size), size)
    return units


plan_units = cut_units  # its name before 'plan' meant the order only


def _row_group_runs(
    path: Path, size: int, unit_bytes: int
) -> list[tuple[int, int, tuple[int, int]]] | None:
    """(first group, stop group, byte span) of each run of row groups of about
    ``unit_bytes``; spans partition the file (the first from byte 0, the last to its
    end). None for a file whose footer cannot be read (its one unit reports the error)."""
    try:
        groups = parquet_row_groups(path)
    except Exception:  # pyarrow raises several types; the reader names the problem
        return None
    if not groups:
        return None
    runs: list[tuple[int, int]] = []
    first, acc = 0, 0
    for g, (_, nbytes, _) in enumerate(groups):
        acc += nbytes
        if acc >= unit_bytes and g + 1 < len(groups):
            runs.append((first, g + 1))
            first, acc = g + 1, 0
    runs.append((first, len(groups)))
    starts = [0] + [groups[a][0] for a, _ in runs[1:]] + [size]
    return [(a, b, (starts[i], starts[i + 1])) for i, (a, b) in enumerate(runs)]


def unit_input_hash(src: InputFile, unit: Unit) -> str:
    """xxh3-128 of the input bytes ``unit`` reads: its span of the file (for a Parquet run
    also the file's footer, which describes every row group), or every file of a folder
    source with its relative name."""
    h = xxhash.xxh3_128()
    if src.path.is_dir():
        for f in _files(src):
            h.update(f.relative_to(src.path).as_posix().encode() + b"\0")
            _hash_span(h, f, 0, None)
        return h.hexdigest()
    a, b = unit.span
    _hash_span(h, src.path, a, b)
    if src.kind == "parquet" and unit.extent is not None:
        size = src.path.stat().st_size
        with open(src.path, "rb") as fh:
            fh.seek(max(0, size - 8))
            tail = fh.read(8)
        footer = int.from_bytes(tail[:4], "little") + 8 if len(tail) == 8 else 0
        _hash_span(h, src.path, max(0, size - footer), size)
    return h.hexdigest()


def _hash_span(h: Any, path: Path, start: int, stop: int | None) -> None:
    with open(path, "rb") as fh:
        fh.seek(start)
        left = None if stop is None else stop - start
        while left is None or left > 0:
            block = fh.read(1 << 22 if left is None else min(left, 1 << 22))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)


def input_identity(sources: list[InputFile]) -> list[list[Any]]:
    """[name, kind, size, mtime_ns] of each source: what every rank must see alike."""
    return [[src.name, src.kind, *source_stat(src)] for src in sources]
