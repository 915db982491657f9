"""Build a token store from raw text (``zephon prepare``).

Role: read documents from text files, folders, JSONL (.jsonl, .jsonl.gz),
JSON, Parquet and local Hugging Face datasets (``save_to_disk`` folders),
tokenize them with a Hugging Face ``tokenizer.json``, and write a token store
(see ``store.py``): every document's tokens followed by one EOS token, in input
order.

Invariant: the store's bytes depend only on the inputs' contents, their names
relative to the given inputs, the tokenizer and ``text_field``; never on the
number of workers, chunking, absolute paths or timing. The store appears at
``output`` atomically (written to a temporary sibling folder, then renamed), so
a store that exists is complete.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.data.store import (
    DOC_OFFSETS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TOKENS,
    StoreError,
    TokenStore,
    manifest_fingerprint,
    write_checksums,
)

EOS_FALLBACKS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".ndjson")
_CHUNK_CHARS = 1 << 20
_CHUNK_DOCS = 2048


# ----------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class TokenizerInfo:
    path: Path  # the tokenizer.json file
    sha256: str
    vocab_size: int
    eos_token: str
    eos_id: int


def load_tokenizer_info(tokenizer_dir: str | os.PathLike) -> TokenizerInfo:
    """Identify the tokenizer in ``tokenizer_dir`` (a folder with tokenizer.json) and its EOS."""
    from tokenizers import Tokenizer

    root = Path(tokenizer_dir)
    tj = root / "tokenizer.json" if root.is_dir() else root
    if not root.exists():
        raise StoreError(
            f"tokenizer folder {str(root)!r} does not exist; expected a folder holding "
            "a Hugging Face tokenizer.json."
        )
    if not tj.is_file() or tj.name != "tokenizer.json":
        raise StoreError(
            f"no tokenizer.json found in {str(root)!r}; expected a folder holding a Hugging "
            "Face tokenizer.json (e.g. from `tokenizer.save_pretrained(DIR)`)."
        )
    data = tj.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode())
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise StoreError(f"cannot load tokenizer {str(tj)!r}: {e}") from None
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    candidates: list[str] = []
    config = tj.parent / "tokenizer_config.json"
    if config.is_file():
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            candidates.append(eos)
    candidates.extend(EOS_FALLBACKS)
    for name in candidates:
        eos_id = tok.token_to_id(name)
        if eos_id is not None:
            return TokenizerInfo(tj, hashlib.sha256(data).hexdigest(), vocab_size, name, eos_id)
    raise StoreError(
        f"cannot determine the EOS token of {str(tj)!r}: tokenizer_config.json gives no "
        f"eos_token in the vocabulary and none of {list(EOS_FALLBACKS)} exists. Add "
        '"eos_token" to tokenizer_config.json.'
    )


def dtype_for_vocab(vocab_size: int) -> str:
    """Smallest store dtype holding every token id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise StoreError(
        f"vocabulary of {vocab_size} tokens is too large: a store holds ids up to 2**32 "
        "(uint32). Use a smaller tokenizer."
    )


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    name: str  # relative, stable name recorded in the manifest
    path: Path
    kind: str  # text | jsonl | json | parquet | hf


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        (path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def _kind_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def resolve_inputs(inputs: list[str]) -> list[Source]:
    """Expand inputs into sources, in the given order; folders walked sorted, hidden skipped."""
    if not inputs:
        raise StoreError("no inputs given; pass at least one file or folder to prepare.")
    sources: list[Source] = []
    for raw in inputs:
        path = Path(raw)
        if not path.exists():
            raise StoreError(
                f"input {raw!r} does not exist; expected a text/JSONL/Parquet file, a folder "
                "or a Hugging Face dataset saved with save_to_disk."
            )
        base = path.resolve().name
        if _is_hf_dataset(path):
            sources.append(Source(base, path, "hf"))
        elif path.is_dir():
            sources.extend(_walk(path, base))
        else:
            sources.append(Source(base, path, _kind_of(path)))
    return sources


def _walk(folder: Path, prefix: str) -> Iterator[Source]:
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        name = f"{prefix}/{entry.name}"
        if _is_hf_dataset(entry):
            yield Source(name, entry, "hf")
        elif entry.is_dir():
            yield from _walk(entry, name)
        elif entry.is_file():
            yield Source(name, entry, _kind_of(entry))


def _source_files(src: Source) -> list[Path]:
    if src.path.is_dir():
        return sorted((p for p in src.path.rglob("*") if p.is_file()), key=lambda p: p.as_posix())
    return [src.path]


def source_record(src: Source) -> dict[str, Any]:
    """Manifest entry: name, kind, sha256 of the content, size in bytes."""
    h = hashlib.sha256()
    size = 0
    for f in _source_files(src):
        if src.path.is_dir():
            h.update(f.relative_to(src.path).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
                size += len(block)
    return {"name": src.name, "kind": src.kind, "sha256": h.hexdigest(), "size": size}


def _field(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise StoreError(
            f"{where}: expected a JSON object with field {text_field!r}, found "
            f"{type(record).__name__}."
        )
    if text_field not in record:
        raise StoreError(
            f"{where}: unknown text field {text_field!r}; fields present: "
            f"{sorted(record)}. Choose one with --text-field."
        )
    value = record[text_field]
    if not isinstance(value, str):
        raise StoreError(
            f"{where}: field {text_field!r} should be a string, found {type(value).__name__}."
        )
    return value


def iter_documents(src: Source, text_field: str) -> Iterator[str]:
    """The documents of one source, in file order, as valid Unicode text.

    Empty documents are skipped. Values that are not strings are refused; lone
    surrogates (common in scraped JSON) become U+FFFD like undecodable bytes do.
    """
    for k, text in enumerate(_raw_documents(src, text_field)):
        if not isinstance(text, str):
            raise StoreError(
                f"{src.path}: document {k} in field {text_field!r} is a "
                f"{type(text).__name__}, not text; choose a text column with --text-field."
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
        yield text


def _raw_documents(src: Source, text_field: str) -> Iterator[Any]:
    if src.kind == "text":
        data = src.path.read_bytes()
        if b"\0" in data[:4096]:
            raise StoreError(
                f"{src.path} looks binary (NUL bytes), not text. Prepare reads text, "
                ".jsonl(.gz), .json, .parquet and Hugging Face datasets; move other files "
                "out of the input folder."
            )
        text = data.decode("utf-8", errors="replace")
        if text:
            yield text
    elif src.kind == "jsonl":
        opener = gzip.open if src.path.name.lower().endswith(".gz") else open
        with opener(src.path, "rt", encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise StoreError(f"{src.path}:{lineno}: invalid JSON ({e}).") from None
                text = _field(record, text_field, f"{src.path}:{lineno}")
                if text:
                    yield text
    elif src.kind == "json":
        try:
            data = json.loads(src.path.read_text(encoding="utf-8", errors="replace"))
        except ValueError:  # maybe JSON lines with a .json suffix
            yield from _raw_documents(Source(src.name, src.path, "jsonl"), text_field)
            return
        records = data if isinstance(data, list) else [data]
        for k, record in enumerate(records):
            text = _field(record, text_field, f"{src.path} record {k}")
            if text:
                yield text
    elif src.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(src.path)
        names = pf.schema_arrow.names
        if text_field not in names:
            raise StoreError(
                f"{src.path}: unknown text field {text_field!r}; columns present: {names}. "
                "Choose one with --text-field."
            )
        for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text
    elif src.kind == "hf":
        yield from _iter_hf(src, text_field)
    else:  # pragma: no cover - kinds are produced above
        raise StoreError(f"unknown source kind {src.kind!r} for {src.path}.")


def _iter_hf(src: Source, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise StoreError(
            f"{src.path} is a Hugging Face dataset folder, but the `datasets` package is not "
            "installed. Install it with `pip install 'torchtitan_zephon[hf]'`."
        ) from None
    ds = datasets.load_from_disk(str(src.path))
    parts = [ds[k] for k in sorted(ds)] if isinstance(ds, datasets.DatasetDict) else [ds]
    for part in parts:
        if text_field not in part.column_names:
            raise StoreError(
                f"{src.path}: unknown text field {text_field!r}; columns present: "
                f"{part.column_names}. Choose one with --text-field."
            )
        for batch in part.select_columns([text_field]).iter(batch_size=1024):
            for text in batch[text_field]:
                if text:
                    yield text


# ----------------------------------------------------------------------------- encoding

_WORKER_TOKENIZER: Any = None
_WORKER_EOS: int = -1


def _init_worker(tokenizer_json: str, eos_id: int, limit_threads: bool) -> None:
    global _WORKER_TOKENIZER, _WORKER_EOS
    if limit_threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER_TOKENIZER = Tokenizer.from_file(tokenizer_json)
    _WORKER_EOS = eos_id


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (uint32, each document followed by EOS) and per-document lengths."""
    tok = _WORKER_TOKENIZER
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = [e.ids for e in encode(texts, add_special_tokens=False)]
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    eos = [_WORKER_EOS]
    flat = np.fromiter(
        itertools.chain.from_iterable(itertools.chain(x, eos) for x in ids),
        dtype=np.uint32,
        count=int(lengths.sum()),
    )
    return flat, lengths


def _chunks(sources: list[Source], text_field: str) -> Iterator[tuple[np.ndarray, list[str]]]:
    """(source index of each document, documents) chunks, in input order."""
    chunk: list[str] = []
    owners: list[int] = []
    chars = 0
    for k, src in enumerate(sources):
        for text in iter_documents(src, text_field):
            chunk.append(text)
            owners.append(k)
            chars += len(text)
            if chars >= _CHUNK_CHARS or len(chunk) >= _CHUNK_DOCS:
                yield np.array(owners, dtype=np.int64), chunk
                chunk, owners, chars = [], [], 0
    if chunk:
        yield np.array(owners, dtype=np.int64), chunk


def _encoded(
    sources: list[Source], text_field: str, info: TokenizerInfo, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(owners, tokens, lengths) of each chunk in input order, computed by ``workers`` processes."""
    if workers <= 1:
        _init_worker(str(info.path), info.eos_id, limit_threads=False)
        for k, texts in _chunks(sources, text_field):
            yield (k, *_encode_chunk(texts))
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(
        workers, initializer=_init_worker, initargs=(str(info.path), info.eos_id, True)
    ) as pool:
        pending: deque = deque()
        for k, texts in _chunks(sources, text_field):
            pending.append((k, pool.apply_async(_encode_chunk, (texts,))))
            if len(pending) >= 2 * workers:
                k0, res = pending.popleft()
                yield (k0, *res.get())
        while pending:
            k0, res = pending.popleft()
            yield (k0, *res.get())


# ----------------------------------------------------------------------------- prepare


def prepare_store(
    inputs: list[str],
    tokenizer: str,
    output: str,
    *,
    workers: int = 1,
    text_field: str = "text",
    progress: bool = True,
) -> TokenStore:
    """Tokenize ``inputs`` into a new token store at ``output`` and open it."""
    out = Path(output)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise StoreError(
            f"output {str(out)!r} already exists; choose another path or delete it first."
        )
    if workers < 1:
        raise StoreError(f"workers must be >= 1, got {workers}.")
    info = load_tokenizer_info(tokenizer)
    dtype_name = dtype_for_vocab(info.vocab_size)
    dtype = np.dtype("<u2" if dtype_name == "uint16" else "<u4")
    sources = resolve_inputs(inputs)
    records = [source_record(s) for s in sources]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        bar = _progress_bar(progress)
        num_tokens = 0
        num_docs = 0
        doc_counts = np.zeros(len(sources), dtype=np.int64)
        token_counts = np.zeros(len(sources), dtype=np.int64)
        with open(tmp / TOKENS, "wb") as ft, open(tmp / DOC_OFFSETS, "wb") as fd:
            for k, flat, lengths in _encoded(sources, text_field, info, workers):
                starts = num_tokens + np.concatenate(([0], np.cumsum(lengths)[:-1]))
                fd.write(starts.astype("<i8").tobytes())
                ft.write(flat.astype(dtype).tobytes())
                num_tokens += int(flat.size)
                num_docs += int(lengths.size)
                np.add.at(doc_counts, k, 1)
                np.add.at(token_counts, k, lengths)
                bar.update(int(lengths.size))
                bar.set_postfix(tokens=num_tokens, refresh=False)
        bar.close()
        if num_tokens == 0:
            raise StoreError(
                f"empty corpus: the inputs {inputs} hold no documents with text "
                f"(text field {text_field!r}). Check the paths and --text-field."
            )
        for rec, docs, toks in zip(
            records, doc_counts.tolist(), token_counts.tolist(), strict=True
        ):
            rec["documents"] = docs
            rec["tokens"] = toks
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "tokenizer": {
                "sha256": info.sha256,
                "vocab_size": info.vocab_size,
                "eos_token": info.eos_token,
            },
            "dtype": dtype_name,
            "eos_id": info.eos_id,
            "num_tokens": num_tokens,
            "num_documents": num_docs,
            "text_field": text_field,
            "sources": records,
        }
        manifest["content"] = write_checksums(tmp, manifest)  # chunk checksums, max token id
        manifest["fingerprint"] = manifest_fingerprint(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()  # an empty folder, checked above
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return TokenStore.open(out)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(desc="zephon prepare", unit=" docs", file=sys.stderr, dynamic_ncols=True)
