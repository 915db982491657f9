"""The documents of ``zephon prepare``'s inputs, in a fixed order.

Role: expand inputs (files, folders, Hugging Face ``save_to_disk`` folders, glob
patterns, comma-separated lists of these) into canonically named sources, and read each source's documents through the reader ``READERS`` names
for its kind: text, JSONL (.jsonl, .jsonl.gz, .ndjson), JSON, Parquet, HF. A new
input kind is a new entry in ``KINDS`` (how to recognise it) and ``READERS``
(how to read it). ``select_splits`` says which splits of a Hugging Face
``DatasetDict`` folder are read: ``train`` unless asked (``all``: every split).

Invariants: the order of sources and of documents depends only on the inputs as
given and the names and contents of the files: folders are walked sorted by
name, hidden entries skipped, glob matches sorted the same way, every real file
and folder visited once (symbolic-link loops end). A source's name is its path
relative to the deepest folder holding every source, whatever the spelling of
the inputs (a folder, a glob of its files, a list of them). Every document is
valid Unicode text; a UTF-8 byte-order mark opening a text, JSONL(.gz) or JSON
file is not part of it (the documents are those of the same file without it).
Input that cannot be read (not text, truncated or corrupt compressed data, JSON
nested too deeply, a broken Parquet file or dataset folder) is a ``StoreError``
naming the file, and the line where there is one; where another value of an
option would fix it (the text field, the split) an ``OptionError``, spelled for
the command that runs (``zephon prepare``'s ``--text-field``, the trainer's
``--zephon.text_field``: ``OptionNames``). A record without the text field in a
file whose other records have it is named as such, never answered by suggesting
another field.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import itertools
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torchtitan_zephon.store.format import StoreError, is_store


@dataclass(frozen=True)
class InputFile:
    """One input file (or Hugging Face dataset folder) of a prepare, as resolved."""

    name: str  # relative, stable name recorded in the manifest
    path: Path
    kind: str  # a key of READERS
    splits: tuple[str, ...] | None = None
    """The splits read, for a Hugging Face DatasetDict folder (``select_splits``); None
    for any other source (a single Dataset folder is read whole)."""


@dataclass(frozen=True)
class OptionNames:
    """How the running command spells the options that choose what is read, for its
    messages: ``zephon prepare``'s (``PREPARE_OPTIONS``) or the trainer's
    (``--zephon.text_field``, ``--zephon.split``)."""

    text_field: str = "--text-field"
    split: str = "--split"


PREPARE_OPTIONS = OptionNames()


class OptionError(StoreError):
    """Bad input that another value of an option fixes (``option``: a field of
    ``OptionNames``); ``spelled`` gives the same message naming the option as another
    command spells it."""

    def __init__(
        self, message: Callable[[str], str], option: str, names: OptionNames = PREPARE_OPTIONS
    ) -> None:
        self.message, self.option = message, option
        super().__init__(message(getattr(names, option)))

    def spelled(self, names: OptionNames) -> OptionError:
        return OptionError(self.message, self.option, names)


ALL_SPLITS = "all"
"""The ``split`` value that reads every split of a DatasetDict (Hugging Face reserves
the name ``all`` for the same meaning)."""
DEFAULT_SPLIT = "train"


# (name suffixes, kind), tried in order; anything else is read as text.
KINDS: list[tuple[tuple[str, ...], str]] = [
    ((".jsonl", ".jsonl.gz", ".ndjson"), "jsonl"),
    ((".json",), "json"),
    ((".parquet",), "parquet"),
]


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        (path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def dataset_dict_splits(path: Path) -> list[str] | None:
    """The splits a DatasetDict folder holds (its dataset_dict.json); None for a folder
    that is a single Dataset."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        return None
    try:
        splits = json.loads(index.read_text(encoding="utf-8"))["splits"]
        if not (isinstance(splits, list) and all(isinstance(x, str) for x in splits)):
            raise ValueError("'splits' is not a list of names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(
            f"{path}: cannot read this Hugging Face dataset folder (dataset_dict.json: {e}): "
            "it is incomplete or corrupt. Save it again with `DatasetDict.save_to_disk`."
        ) from None
    return splits


def _saved_split(path: Path) -> str | None:
    """The split a single Dataset folder was saved as (its state.json), if it says."""
    try:
        split = json.loads((path / "state.json").read_text(encoding="utf-8")).get("_split")
    except (OSError, ValueError, AttributeError):
        return None
    return split if isinstance(split, str) else None


def select_splits(
    sources: list[InputFile], split: str = "", names: OptionNames = PREPARE_OPTIONS
) -> list[InputFile]:
    """``sources`` with the splits each Hugging Face DatasetDict folder reads: ``split``
    (empty: ``train``), or every split in sorted order for ``all``. A DatasetDict without
    that split is an ``OptionError`` listing the splits it has. A single Dataset folder
    is read whole; an explicit ``split`` other than the one it was saved as (when its
    state.json records one) is refused. Other sources are unchanged."""
    out: list[InputFile] = []
    for src in sources:
        present = dataset_dict_splits(src.path) if src.kind == "hf" else None
        if src.kind != "hf":
            out.append(src)
        elif present is None:
            saved = _saved_split(src.path)
            if split and split != ALL_SPLITS and saved is not None and saved != split:
                raise OptionError(
                    lambda o, src=src, saved=saved: (
                        f"{src.path} is a single Hugging Face Dataset saved as split {saved!r} "
                        f"(not a DatasetDict), so {o} {split} cannot select from it. Give the "
                        f"folder of the {split!r} split, or drop {o} (a single Dataset is read "
                        "whole)."
                    ),
                    "split",
                    names,
                )
            out.append(src)
        elif split == ALL_SPLITS:
            out.append(replace(src, splits=tuple(sorted(present))))
        elif (split or DEFAULT_SPLIT) in present:
            out.append(replace(src, splits=(split or DEFAULT_SPLIT,)))
        else:
            which = (
                f"no split {split!r}"
                if split
                else f"no {DEFAULT_SPLIT!r} split, which is read by default"
            )
            raise OptionError(
                lambda o, src=src, present=present, which=which: (
                    f"{src.path} is a Hugging Face DatasetDict with the splits "
                    f"{sorted(present)}; it has {which}. Choose one with {o} NAME, or {o} "
                    f"{ALL_SPLITS} to read every split."
                ),
                "split",
                names,
            )
    return out


def _kind_of(path: Path) -> str:
    name = path.name.lower()
    for suffixes, kind in KINDS:
        if name.endswith(suffixes):
            return kind
    return "text"


GLOB_CHARS = frozenset("*?[")


def expand_input(raw: str) -> list[str]:
    """The paths one input names: itself when it exists; else, split at commas, each
    piece itself (when it exists) or a glob pattern's matches, sorted as a folder walk
    sorts (by name, level by level; ``**`` spans folders). An error names a piece that
    does not exist and a pattern that matches nothing."""
    if not raw:
        raise StoreError("an input is empty; expected a file, a folder or a glob pattern.")
    if os.path.lexists(raw):
        return [raw]
    pieces = [p.strip() for p in raw.split(",")] if "," in raw else [raw]
    out: list[str] = []
    for piece in pieces:
        if not piece:
            raise StoreError(
                f"input {raw!r} has an empty item between commas; expected a comma-separated "
                "list of files, folders or glob patterns."
            )
        if os.path.lexists(piece):
            out.append(piece)
        elif GLOB_CHARS & set(piece):
            matches = glob.glob(piece, recursive=True)
            if not matches:
                raise StoreError(
                    f"input pattern {piece!r} matches no file; expected a glob pattern of "
                    "text/JSONL/Parquet files or folders (hidden names match only a pattern "
                    "that starts with a dot)."
                )
            out.extend(sorted(matches, key=lambda m: Path(m).parts))
        else:
            within = f" (in {raw!r})" if piece != raw else ""
            raise StoreError(
                f"input {piece!r}{within} does not exist; expected a text/JSONL/Parquet file, "
                "a folder, a glob pattern or a Hugging Face dataset saved with save_to_disk."
            )
    return out


def resolve_inputs(inputs: list[str]) -> list[InputFile]:
    """Expand inputs into sources, in the given order; folders walked sorted, hidden skipped.

    Every input is expanded (``expand_input``: a path, a glob pattern or a
    comma-separated list of them) into entries: a file is one entry, a Hugging
    Face dataset folder is one entry, any other folder is walked into its files
    (and dataset folders). Every real file and folder is visited once, at its
    first place: a symbolic link to something already visited (a loop such as
    ``sub/up -> ..``, a second name of a file, a file listed twice or reached by
    two inputs) is skipped, and so are links that lead nowhere.

    A token store (a folder ``zephon prepare`` made) holds no raw text: inside a
    folder input it is skipped (a store prepared next to its corpus does not break
    the next prepare of that folder); given as an input it is refused.

    Names are canonical: each entry is named by its path relative to the deepest
    folder that holds every entry (one file: its base name). So a folder, a glob of
    its files and a list of the same files give the same names, and the same store.
    """
    if not inputs:
        raise StoreError("no inputs given; pass at least one file or folder to prepare.")
    entries: list[tuple[str, Path, str]] = []  # (absolute path as reached, path, kind)
    seen: set[Path] = set()
    for raw in inputs:
        for given in expand_input(raw):
            path = Path(given)
            try:
                real = path.resolve(strict=True)
            except (OSError, RuntimeError):
                raise StoreError(
                    f"input {given!r} is a link that leads nowhere (or a loop of links); "
                    "expected a text/JSONL/Parquet file, a folder or a Hugging Face dataset."
                ) from None
            if real in seen:
                continue
            seen.add(real)
            if path.is_dir() and is_store(path):
                raise StoreError(
                    f"input {given!r} is a token store (made by zephon prepare), not raw "
                    f"text; train on it as it is (--zephon.store {given}), or prepare "
                    "the raw files it was made from."
                )
            if _is_hf_dataset(path):
                entries.append((os.path.abspath(given), path, "hf"))
            elif path.is_dir():
                entries.extend(_walk(path, os.path.abspath(given), seen))
            else:
                entries.append((os.path.abspath(given), path, _kind_of(path)))
    if not entries:
        return []
    root = os.path.commonpath([os.path.dirname(a) for a, _, _ in entries])
    return [InputFile(Path(os.path.relpath(a, root)).as_posix(), p, k) for a, p, k in entries]


def _walk(folder: Path, at: str, seen: set[Path]) -> Iterator[tuple[str, Path, str]]:
    """(absolute path as reached, path, kind) of the entries under ``folder`` (reached
    as ``at``) sorted by name, level by level; ``seen`` holds the real paths visited."""
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        try:
            real = entry.resolve(strict=True)
        except (OSError, RuntimeError):  # a dangling link, or a loop of links
            continue
        if real in seen:
            continue
        name = os.path.join(at, entry.name)
        if _is_hf_dataset(entry):
            seen.add(real)
            yield name, entry, "hf"
        elif entry.is_dir() and is_store(entry):  # prepared tokens, not raw text: skipped
            seen.add(real)
        elif entry.is_dir():
            seen.add(real)
            yield from _walk(entry, name, seen)
        elif entry.is_file():
            seen.add(real)
            yield name, entry, _kind_of(entry)


def _source_files(src: InputFile) -> list[Path]:
    if src.path.is_dir():
        return sorted((p for p in src.path.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    return [src.path]


def source_record(src: InputFile) -> dict[str, Any]:
    """Manifest entry: name, kind, sha256 of the content, size in bytes; for a
    DatasetDict, the splits read."""
    h = hashlib.sha256()
    size = 0
    for f in _source_files(src):
        if src.path.is_dir():
            h.update(f.relative_to(src.path).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
                size += len(block)
    record = {"name": src.name, "kind": src.kind, "sha256": h.hexdigest(), "size": size}
    if src.splits is not None:  # only DatasetDict sources: other manifests stay as they were
        record["splits"] = list(src.splits)
    return record


_LOOK_AHEAD = 1000
"""Records read past one without the text field, to tell a file that lacks the field
(another field is meant) from one whose odd record lacks it (an error only)."""


def _field(record: Any, text_field: str, where: str, others: Callable[[], bool]) -> str:
    """The text of one JSON record; ``others()`` (asked only when the field is missing)
    says whether other records of its file have the field."""
    if not isinstance(record, dict):
        raise StoreError(
            f"{where}: expected a JSON object with field {text_field!r}, found "
            f"{type(record).__name__}."
        )
    if text_field not in record:
        fields = sorted(record)
        if others():
            raise StoreError(
                f"{where}: this record has no field {text_field!r} (its fields: {fields}), "
                f"but other records of the file have it. Fix or drop the records without it."
            )
        raise OptionError(
            lambda o: (
                f"{where}: unknown text field {text_field!r}; fields present: {fields}. "
                f"Choose one with {o}."
            ),
            "text_field",
        )
    value = record[text_field]
    if not isinstance(value, str):
        raise StoreError(
            f"{where}: field {text_field!r} should be a string, found {type(value).__name__}."
        )
    return value


def _has_field(line: str, text_field: str) -> bool:
    """Whether a JSON line (maybe blank or invalid) is an object with ``text_field``."""
    if not line.strip():
        return False
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(record, dict) and text_field in record


def _any_has_field(lines: Iterable[str], text_field: str) -> bool:
    """Whether one of the next ``_LOOK_AHEAD`` non-blank ``lines`` has ``text_field``."""
    checked = 0
    try:
        for line in lines:
            if line.strip():
                if _has_field(line, text_field):
                    return True
                checked += 1
                if checked >= _LOOK_AHEAD:
                    break
    except (EOFError, OSError, zlib.error):  # a damaged rest: judge by the lines read
        pass
    return False


def iter_documents(
    src: InputFile, text_field: str, part: tuple[int, int] | None = None
) -> Iterator[str]:
    """The documents of one source (or of one ``part`` of it), in file order, as valid
    Unicode text.

    ``part`` is a range ``[start, stop)`` a ``RANGE_READERS`` reader understands (bytes
    of a plain JSONL file at line starts, row groups of a Parquet file): the documents
    of consecutive parts covering a source, concatenated, are the source's documents.
    Empty documents are skipped. Values that are not strings are refused; lone
    surrogates (common in scraped JSON) become U+FFFD like undecodable bytes do.
    """
    if part is None:
        reader = READERS.get(src.kind)
    else:
        ranged = RANGE_READERS.get(src.kind)
        reader = None if ranged is None else lambda s, f: ranged(s, f, *part)
    if reader is None:  # pragma: no cover - kinds come from KINDS and resolve_inputs
        raise StoreError(f"unknown source kind {src.kind!r} for {src.path}.")
    for k, text in enumerate(reader(src, text_field)):
        if not isinstance(text, str):
            kind = type(text).__name__
            raise OptionError(
                lambda o, k=k, kind=kind: (
                    f"{src.path}: document {k} in field {text_field!r} is a {kind}, not text; "
                    f"choose a text column with {o}."
                ),
                "text_field",
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        yield text


# ----------------------------------------------------------------------------- readers
# Each reader yields the raw documents of one source; iter_documents checks them.


# Leading bytes of compressed files that prepare would otherwise read as text.
_COMPRESSED = [
    (b"\x1f\x8b", "gzip", "gunzip FILE"),
    (b"BZh", "bzip2", "bunzip2 FILE"),
    (b"\xfd7zXZ\x00", "xz", "unxz FILE"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd FILE"),
    (b"PK\x03\x04", "zip", "unzip FILE"),
]


def read_text(src: InputFile, text_field: str) -> Iterator[Any]:
    """The whole file is one document (undecodable bytes become U+FFFD)."""
    data = src.path.read_bytes()
    for magic, kind, tool in _COMPRESSED:
        if data.startswith(magic):
            raise StoreError(
                f"{src.path} is {kind}-compressed; prepare decompresses only gzip JSON lines "
                f"named .jsonl.gz. Decompress it first (`{tool}`), or, if it holds gzip JSON "
                "lines, name it .jsonl.gz."
            )
    if b"\0" in data[:4096]:
        raise StoreError(
            f"{src.path} looks binary (NUL bytes), not text. Prepare reads text, "
            ".jsonl(.gz), .json, .parquet and Hugging Face datasets; move other files "
            "out of the input folder."
        )
    text = data.decode("utf-8-sig", errors="replace")  # -sig: a leading BOM is no text
    if text:
        yield text


def _too_deep(where: str) -> StoreError:
    return StoreError(
        f"{where}: JSON nested too deeply to parse (Python's parser stops near "
        f"{sys.getrecursionlimit()} levels of [ or {{). A document is a JSON object with a "
        "text field; check what wrote this file."
    )


def read_jsonl(src: InputFile, text_field: str) -> Iterator[Any]:
    """One JSON object per line, its ``text_field`` a document; blank lines skipped.

    A truncated or corrupt ``.gz`` stream is an error naming the last line read.
    """
    compressed = src.path.name.lower().endswith(".gz")
    opener = gzip.open if compressed else open
    lineno = 0
    try:
        with opener(src.path, "rt", encoding="utf-8-sig", errors="replace") as fh:
            seen = False  # a record with the text field was read
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except RecursionError:
                    raise _too_deep(f"{src.path}:{lineno}") from None
                except ValueError as e:
                    raise StoreError(f"{src.path}:{lineno}: invalid JSON ({e}).") from None
                if _plain(record, text_field):
                    text = record[text_field]
                else:
                    text = _field(
                        record,
                        text_field,
                        f"{src.path}:{lineno}",
                        lambda seen=seen: seen or _any_has_field(fh, text_field),
                    )
                seen = True
                if text:
                    yield text
    except EOFError:
        raise StoreError(
            f"{src.path}: the compressed stream ends after line {lineno}: the file is "
            "truncated (an interrupted download or copy?). Fetch it again; `gzip -t FILE` "
            "checks a gzip file."
        ) from None
    except (zlib.error, gzip.BadGzipFile) as e:
        if lineno == 0 and isinstance(e, gzip.BadGzipFile):
            raise StoreError(
                f"{src.path}: not a gzip file ({e}), although its name ends in .gz. Rename "
                "it (e.g. to .jsonl) if it is plain JSON lines."
            ) from None
        raise StoreError(
            f"{src.path}: corrupt gzip data after line {lineno} ({e}). Fetch the file "
            "again; `gzip -t FILE` checks a gzip file."
        ) from None


def is_line_start(data: bytes, p: int) -> bool:
    """Whether byte ``p`` (0 < p < len(data)) of ``data`` starts a line, as Python's text
    files split lines (universal newlines: after \\n, after \\r not followed by \\n)."""
    before = data[p - 1]
    return before == 0x0A or (before == 0x0D and data[p] != 0x0A)


def _lines_before(path: Path, offset: int) -> int:
    """How many lines (universal newlines) end before byte ``offset`` of ``path``: the line
    number of the line starting there is this plus one. Only error messages need it."""
    count, last = 0, b""
    with open(path, "rb") as fh:
        left = offset
        while left:
            block = fh.read(min(left, 1 << 24))
            if not block:
                break
            left -= len(block)
            # \r\n counts once: a \r followed by \n (also across blocks) is not a line end
            count += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
            if last == b"\r" and block[:1] == b"\n":
                count -= 1
            last = block[-1:]
    return count


def read_jsonl_range(src: InputFile, text_field: str, start: int, stop: int) -> Iterator[Any]:
    """``read_jsonl`` of the lines in bytes ``[start, stop)`` of a plain (not compressed)
    JSON lines file; ``start`` and ``stop`` are line starts (or 0 and the file's size).

    The same lines, documents and errors (naming the file and the line) as ``read_jsonl``
    gives for those lines: universal newlines, undecodable bytes as U+FFFD.
    """
    with open(src.path, "rb") as fh:
        fh.seek(start)
        data = fh.read(stop - start)
    if start == 0 and data.startswith(codecs.BOM_UTF8):  # only the first unit can see it
        data = data[len(codecs.BOM_UTF8) :]
    text = data.decode("utf-8", errors="replace")
    del data
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    first: list[int] = []  # the line number of the range's first line, computed on error

    def where(i: int) -> str:
        if not first:
            first.append(_lines_before(src.path, start) + 1)
        return f"{src.path}:{first[0] + i}"

    lines = text.split("\n")
    seen = False  # a record with the text field was read
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            raise _too_deep(where(i)) from None
        except ValueError as e:
            raise StoreError(f"{where(i)}: invalid JSON ({e}).") from None
        if _plain(record, text_field):
            value = record[text_field]
        else:

            def others(i: int = i, seen: bool = seen) -> bool:
                """As ``read_jsonl`` judges: a record before it has the field (before the
                range: the file's first record does; the earliest error is the one
                reported, so the records before it have the field), or one of the next
                records does (past the range too)."""
                ahead = itertools.chain(lines[i + 1 :], _lines_from(src.path, stop))
                return (
                    seen
                    or (start > 0 and _first_record_has_field(src.path, text_field))
                    or _any_has_field(ahead, text_field)
                )

            value = _field(record, text_field, where(i), others)  # raises, naming the line
        seen = True
        if value:
            yield value


def _lines_from(path: Path, offset: int) -> Iterator[str]:
    """The lines of a file from byte ``offset`` (a line start) on, as text mode reads them."""
    with open(path, "rb") as raw:
        raw.seek(offset)
        yield from io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


def _first_record_has_field(path: Path, text_field: str) -> bool:
    """Whether the first non-blank line of a JSON lines file has ``text_field``: when it
    does, a later record without it is an odd record, not another field's file (and if
    it does not, the file's first unit reports that)."""
    with open(path, encoding="utf-8-sig", errors="replace") as fh:
        for line in fh:
            if line.strip():
                return _has_field(line, text_field)
    return False


def _plain(record: Any, text_field: str) -> bool:
    """A JSON object whose ``text_field`` is a string: the common case, checked cheaply."""
    return type(record) is dict and type(record.get(text_field)) is str


def read_json(src: InputFile, text_field: str) -> Iterator[Any]:
    """A JSON list of objects (or one object); JSON lines with a .json suffix also work."""
    try:
        data = json.loads(src.path.read_text(encoding="utf-8-sig", errors="replace"))
    except RecursionError:
        raise _too_deep(str(src.path)) from None
    except ValueError:  # maybe JSON lines with a .json suffix
        yield from read_jsonl(src, text_field)
        return
    records = data if isinstance(data, list) else [data]

    def others() -> bool:
        return any(isinstance(r, dict) and text_field in r for r in records)

    for k, record in enumerate(records):
        text = _field(record, text_field, f"{src.path} record {k}", others)
        if text:
            yield text


def read_parquet(src: InputFile, text_field: str) -> Iterator[Any]:
    """The ``text_field`` column, row by row."""
    return read_parquet_row_groups(src, text_field, 0, None)


def parquet_row_groups(path: Path) -> list[tuple[int, int, int]]:
    """(first byte, compressed bytes, rows) of each row group of a Parquet file, from its
    footer; raises pyarrow's errors for a file that is not readable Parquet."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    groups = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        starts, size = [], 0
        for c in range(rg.num_columns):
            col = rg.column(c)
            dict_offset = col.dictionary_page_offset if col.has_dictionary_page else None
            starts.append(dict_offset if dict_offset else col.data_page_offset)
            size += col.total_compressed_size
        groups.append((min(starts) if starts else 0, size, rg.num_rows))
    return groups


def read_parquet_row_groups(
    src: InputFile, text_field: str, first: int, stop: int | None
) -> Iterator[Any]:
    """The ``text_field`` column of row groups ``[first, stop)`` (``stop`` None: to the
    end), row by row; a corrupt file is an error naming it and the last row read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 0
    try:
        pf = pq.ParquetFile(src.path)
        rows = sum(pf.metadata.row_group(g).num_rows for g in range(first))
        names = pf.schema_arrow.names
        if text_field not in names:
            raise OptionError(
                lambda o: (
                    f"{src.path}: unknown text field {text_field!r}; columns present: {names}. "
                    f"Choose one with {o}."
                ),
                "text_field",
            )
        groups = None if stop is None else list(range(first, stop))
        for batch in pf.iter_batches(columns=[text_field], batch_size=4096, row_groups=groups):
            for text in batch.column(0).to_pylist():
                rows += 1
                if text:
                    yield text
    except (pa.ArrowException, OSError) as e:
        raise StoreError(
            f"{src.path}: cannot read Parquet after row {rows} ({e}): the file is truncated, "
            "corrupt or not Parquet. Fetch or write it again."
        ) from None


def read_hf(src: InputFile, text_field: str) -> Iterator[Any]:
    """A ``save_to_disk`` Dataset, or the splits of a DatasetDict that ``src.splits``
    names in that order (a source not given them by ``select_splits``: the default)."""
    try:
        import datasets
    except ImportError:
        raise StoreError(
            f"{src.path} is a Hugging Face dataset folder, but the `datasets` package is not "
            "installed. Install it with `pip install 'torchtitan_zephon[hf]'`."
        ) from None
    import pyarrow as pa

    try:
        ds = datasets.load_from_disk(str(src.path))
        if isinstance(ds, datasets.DatasetDict):
            splits = src.splits if src.splits is not None else select_splits([src])[0].splits
            parts = [ds[k] for k in splits or ()]
        else:
            parts = [ds]
        for part in parts:
            if text_field not in part.column_names:
                raise OptionError(
                    lambda o, columns=part.column_names: (
                        f"{src.path}: unknown text field {text_field!r}; columns present: "
                        f"{columns}. Choose one with {o}."
                    ),
                    "text_field",
                )
            for batch in part.select_columns([text_field]).iter(batch_size=1024):
                for text in batch[text_field]:
                    if text:
                        yield text
    except StoreError:
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError) as e:  # ValueError: its JSON
        raise StoreError(
            f"{src.path}: cannot read this Hugging Face dataset folder ({e}): it is "
            "incomplete or corrupt. Save it again with `Dataset.save_to_disk`."
        ) from None


READERS: dict[str, Callable[[InputFile, str], Iterator[Any]]] = {
    "text": read_text,
    "jsonl": read_jsonl,
    "json": read_json,
    "parquet": read_parquet,
    "hf": read_hf,
}

# Readers of one part of a source (see ``iter_documents``): (src, text_field, start, stop).
RANGE_READERS: dict[str, Callable[[InputFile, str, int, int], Iterator[Any]]] = {
    "jsonl": read_jsonl_range,
    "parquet": read_parquet_row_groups,
}
