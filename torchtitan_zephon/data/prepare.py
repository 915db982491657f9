"""Build a token store from raw text (``zephon prepare``).

Role: identify the tokenizer (a Hugging Face ``tokenizer.json`` and its EOS),
read the inputs' documents (``readers.py``: text files, folders, JSONL, JSON,
Parquet, local Hugging Face datasets), tokenize them in chunks (``encode.py``,
optionally in worker processes) and write a token store (see ``store.py``):
every document's tokens followed by one EOS token, in input order.

Invariant: the store's bytes depend only on the inputs' contents, their names
relative to the given inputs, the tokenizer and ``text_field``; never on the
number of workers, chunking, absolute paths or timing. The store appears at
``output`` atomically (written to a temporary sibling folder, then renamed), so
a store that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.data.encode import encode_in_order, max_workers
from torchtitan_zephon.data.readers import Source, iter_documents, resolve_inputs, source_record
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


# ----------------------------------------------------------------------------- encoding


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
    yield from encode_in_order(_chunks(sources, text_field), str(info.path), info.eos_id, workers)


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
    most = max_workers()
    if not 1 <= workers <= most:
        raise StoreError(
            f"workers must be in [1, {most}] (4 tokenizer processes per CPU at most), got "
            f"{workers}."
        )
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
    from tqdm import tqdm  # a declared dependency: the bar never silently disappears

    return tqdm(desc="zephon prepare", unit=" docs", file=sys.stderr, dynamic_ncols=True)
