"""The documents of one source, in file order: the reader its kind names, checked.

Role: ``iter_documents`` reads a source (``inputs.InputFile``), or one extent of it
(a unit's range),
through ``READERS`` (``RANGE_READERS`` for an extent); this module holds the
readers of text files, Parquet files and Hugging Face dataset folders, and
``json_readers`` those of JSON and JSON lines.

Invariants: every document is valid Unicode text (lone surrogates become U+FFFD,
as undecodable bytes do); the documents of consecutive parts covering a source,
concatenated, are the source's documents. A UTF-8 byte-order mark opening a
text, JSONL(.gz) or JSON file is not part of it. Input that cannot be read (not
text, compressed, a broken Parquet file or dataset folder) is a ``StoreError``
naming the file; a missing text field or split an ``inputs.OptionError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torchtitan_zephon.ingest.inputs import InputFile, OptionError, select_splits
from torchtitan_zephon.ingest.json_readers import json_kind, read_json, read_jsonl, read_jsonl_range
from torchtitan_zephon.store.format import StoreError


def iter_documents(
    src: InputFile, text_field: str, extent: tuple[int, int] | None = None
) -> Iterator[str]:
    """The documents of one source (or of one ``extent`` of it), in file order, as valid
    Unicode text.

    ``extent`` is a range ``[start, stop)`` a ``RANGE_READERS`` reader understands (bytes
    of a plain JSONL file at line starts, row groups of a Parquet file): the documents
    of consecutive parts covering a source, concatenated, are the source's documents.
    Empty documents are skipped. Values that are not strings are refused; lone
    surrogates (common in scraped JSON) become U+FFFD like undecodable bytes do.
    """
    if extent is None:
        reader = READERS.get(src.kind)
    else:
        ranged = RANGE_READERS.get(src.kind)
        reader = None if ranged is None else lambda s, f: ranged(s, f, *extent)
    if reader is None:  # pragma: no cover - kinds come from KINDS and resolve_inputs
        raise StoreError(f"unknown source kind {src.kind!r} for {src.path}.")
    for k, text in enumerate(reader(src, text_field)):
        if not isinstance(text, str):
            kind = json_kind(text)
            raise OptionError(
                lambda o, k=k, kind=kind: (
                    f"{src.path}: document {k} in field {text_field!r} is {kind}, not text; "
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
            datasets_read = [ds[k] for k in splits or ()]
        else:
            datasets_read = [ds]
        for split in datasets_read:
            if text_field not in split.column_names:
                raise OptionError(
                    lambda o, columns=split.column_names: (
                        f"{src.path}: unknown text field {text_field!r}; columns present: "
                        f"{columns}. Choose one with {o}."
                    ),
                    "text_field",
                )
            for batch in split.select_columns([text_field]).iter(batch_size=1024):
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

# Readers of one extent of a source (see ``iter_documents``): (src, text_field, start, stop).
RANGE_READERS: dict[str, Callable[[InputFile, str, int, int], Iterator[Any]]] = {
    "jsonl": read_jsonl_range,
    "parquet": read_parquet_row_groups,
}
