"""Readers of JSON lines (.jsonl, .jsonl.gz, .ndjson) and JSON files: each record's text field.

Role: a record is a JSON object; its ``text_field`` (a string) is a document.
``read_jsonl_range`` reads the lines of a byte range of a plain JSONL file (a
unit's extent: ``units``), starting at a line start (``is_line_start``).

Invariants: a record without the text field in a file whose other records have
it is named as such (its line), never answered by suggesting another field; a
file none of whose first records has the field is an ``inputs.OptionError``
naming the fields present. Invalid JSON, JSON nested too deeply and truncated
or corrupt gzip data are a ``StoreError`` naming the file (and the line).
"""

from __future__ import annotations

import codecs
import gzip
import io
import itertools
import json
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.inputs import InputFile, OptionError
from torchtitan_zephon.store.format import StoreError

_LOOK_AHEAD = 1000
"""Records read past one without the text field, to tell a file that lacks the field
(another field is meant) from one whose odd record lacks it (an error only)."""


def json_kind(value: Any) -> str:
    """What a value is, in JSON's words (``null``, ``a number``, ``an array``, ...), for
    messages: never a Python type name."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a value of type {type(value).__name__}"  # Parquet / datasets: bytes, dates


def _field(record: Any, text_field: str, where: str, others: Callable[[], bool]) -> str:
    """The text of one JSON record; ``others()`` (asked only when the field is missing)
    says whether other records of its file have the field."""
    if not isinstance(record, dict):
        raise StoreError(
            f"{where}: expected a JSON object with field {text_field!r}, found {json_kind(record)}."
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
            f"{where}: field {text_field!r} should be a string, found {json_kind(value)}."
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
