"""Corpora already tokenized, read in place: Megatron-LM indexed datasets and OLMo's
numpy token files registered as a store (``zephon prepare FILES --input-format
megatron|numpy --tokenizer DIR --output STORE``).

Role: a corpus of 15 T tokens is tokenized once, by the framework that wrote it;
tokenizing it again would cost ~5,500 core-hours. Registering reads every token once
(content checksums, the largest id, document ends) and writes only metadata into the
store folder: the manifest, ``doc_offsets.bin`` (8 bytes a document), ``checksums.bin``
(8 bytes per 65,536 tokens) and ``shards.json`` naming the token files where they are
(``store.shards``: each file one shard, read in place). The tokens are never copied.

Formats accepted (anything else is refused, naming the file):

- ``megatron``: Megatron-LM's indexed dataset (``MMapIndexedDataset``), a ``.bin`` of
  the tokens and its ``.idx``: the header ``MMIDIDX\\x00\\x00``, version 1, the dtype
  code (8: uint16; 4: int32, read as uint32, the same bytes for every id below 2^31),
  the sequence and document counts, then int32 sequence lengths, int64 sequence
  pointers (byte offsets into ``.bin``: the sequences must lie back to back from 0, as
  ``preprocess_data.py`` writes them) and int64 document indices (document k is
  sequences ``[indices[k], indices[k + 1])``; one document a sequence or several).
  Name a file by its prefix, its ``.bin`` or its ``.idx``. Megatron ends documents with
  the tokenizer's EOD only with ``--append-eod``: Zephon's samples need every document
  to end with EOS, so a document that does not is refused.
- ``numpy``: OLMo(-core)'s token files: flat raw arrays (no ``.npy`` header) of the
  dtype the tokenizer's vocabulary needs (uint16 up to 65,536 ids, else uint32),
  documents ended by the tokenizer's EOS; a file's last token must be EOS.

Invariants:
- The same tokens with the same document boundaries give the store that ``zephon
  prepare`` makes of the same text: the same samples, documents and order (the
  fingerprint differs: its sources are other files).
- Registering writes nothing until every check passed, and then only into a new
  folder renamed to the output last: a refused registration leaves no output. Every
  id is below the tokenizer's vocabulary, every document holds at least one token and
  ends with EOS, the dtype holds the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.ingest.tokenizer import dtype_for_vocab, load_tokenizer_info
from torchtitan_zephon.store.format import (
    CHECKSUMS,
    DOC_OFFSETS,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    StoreError,
    content_checksums,
    content_section,
    manifest_fingerprint,
)
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import ShardedTokens, write_shard_list

INPUT_FORMATS = ("text", "megatron", "numpy")
"""``zephon prepare --input-format``: text to tokenize (the default), or token files."""
MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {8: "uint16", 4: "uint32"}  # int32 read as uint32: the same bytes
SCAN_TOKENS = 1 << 24
"""Tokens read at a time when a file is scanned (bounded memory for any file size)."""


@dataclass
class TokenFile:
    """One token file read in place: its path, the dtype of its tokens, their count and
    the first token of each of its documents (from 0, within the file)."""

    path: Path
    kind: str
    dtype: str
    tokens: int
    doc_starts: np.ndarray


def _refuse(path: Path, what: str) -> StoreError:
    return StoreError(f"{path}: {what}; nothing was written.")


def read_megatron(name: str) -> TokenFile:
    """The ``.bin`` of the Megatron-LM indexed dataset ``name`` (a prefix, or its ``.bin``
    or ``.idx``), its documents from its ``.idx``, checked against each other."""
    base = name[:-4] if name.endswith((".bin", ".idx")) else name
    binary, index = Path(base + ".bin"), Path(base + ".idx")
    for p in (binary, index):
        if not p.is_file():
            raise _refuse(p, "not found: a Megatron-LM indexed dataset is a .bin and its .idx")
    data = index.read_bytes()
    head = len(MEGATRON_HEADER) + 8 + 1 + 8 + 8
    if len(data) < head or not data.startswith(MEGATRON_HEADER):
        raise _refuse(
            index,
            f"not a Megatron-LM index (expected the header {MEGATRON_HEADER!r} of "
            "MMapIndexedDataset)",
        )
    version, code, sequences, documents = struct.unpack_from("<QBQQ", data, len(MEGATRON_HEADER))
    if version != 1:
        raise _refuse(index, f"Megatron-LM index version {version}; Zephon reads version 1")
    if code not in MEGATRON_DTYPES:
        raise _refuse(
            index,
            f"token dtype code {code}; Zephon reads uint16 (code 8) and int32 (code 4) tokens",
        )
    need = head + sequences * (4 + 8) + documents * 8
    if len(data) < need:
        raise _refuse(
            index, f"truncated: {len(data)} bytes for {sequences} sequences and {documents} "
            f"document indices ({need} bytes)"
        )  # fmt: skip
    lengths = np.frombuffer(data, "<i4", sequences, head).astype(np.int64)
    pointers = np.frombuffer(data, "<i8", sequences, head + sequences * 4)
    indices = np.frombuffer(data, "<i8", documents, head + sequences * 12)
    dtype = MEGATRON_DTYPES[code]
    item = DTYPES[dtype].itemsize
    size = binary.stat().st_size
    starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum()) if sequences else 0
    if (lengths < 0).any() or not np.array_equal(pointers, starts * item) or total * item != size:
        raise _refuse(
            index,
            f"its counts disagree with {binary.name} ({size} bytes: {size // item} tokens of "
            f"{dtype}; the index holds {sequences} sequences of {total} tokens, which must "
            "lie back to back from byte 0)",
        )
    if documents < 2 or indices[0] != 0 or indices[-1] != sequences or (np.diff(indices) < 1).any():
        raise _refuse(
            index,
            "its document indices must run from 0 to the sequence count, each document "
            "at least one sequence",
        )
    doc_starts = starts[indices[:-1]]
    ends = np.append(doc_starts[1:], total)
    if (ends - doc_starts < 1).any():
        raise _refuse(index, "a document holds no token")
    return TokenFile(binary, "megatron", dtype, total, doc_starts.astype(np.int64))


def read_numpy(name: str, dtype: str, eos_id: int) -> TokenFile:
    """The OLMo token file ``name`` (a raw array of ``dtype``), its documents: each ended
    by ``eos_id``."""
    path = Path(name)
    if not path.is_file():
        raise _refuse(path, "not found")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":
        raise _refuse(
            path,
            "an .npy file with a header; OLMo's token files are raw arrays (np.memmap): "
            "write the array with tofile(), or pass its raw data",
        )
    item = DTYPES[dtype].itemsize
    size = path.stat().st_size
    if size == 0 or size % item:
        raise _refuse(
            path, f"{size} bytes is not a whole number of {dtype} tokens (the tokenizer's dtype)"
        )
    count = size // item
    tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r", shape=(count,))
    if int(tokens[-1]) != eos_id:
        raise _refuse(
            path,
            f"its last token is {int(tokens[-1])}, not the tokenizer's EOS {eos_id}: OLMo's "
            "token files end every document with EOS (is it the tokenizer the file was "
            "written with?)",
        )
    ends = []
    for lo in range(0, count, SCAN_TOKENS):
        ends.append(np.flatnonzero(np.asarray(tokens[lo : lo + SCAN_TOKENS]) == eos_id) + lo)
    starts = np.concatenate([[0], np.concatenate(ends)[:-1] + 1]).astype(np.int64)
    return TokenFile(path, "numpy", dtype, count, starts)


def register_store(files: list[str], input_format: str, tokenizer: str, output: str) -> TokenStore:
    """A store at ``output`` over the token files ``files`` (``input_format`` "megatron"
    or "numpy"), read in place (see the module docstring), opened."""
    if input_format not in ("megatron", "numpy"):
        raise StoreError(
            f"input format {input_format!r}: expected one of megatron, numpy (text is "
            "tokenized by zephon prepare)."
        )
    out = Path(os.path.abspath(output))
    if out.exists():
        raise StoreError(f"output {out} already exists; choose another path; nothing was written.")
    if not files:
        raise StoreError("no token files given; nothing was written.")
    info = load_tokenizer_info(tokenizer)
    need = dtype_for_vocab(info.vocab_size)
    if input_format == "megatron":
        found = [read_megatron(f) for f in files]
    else:
        found = [read_numpy(f, need, info.eos_id) for f in files]
    for tf in found:
        if DTYPES[tf.dtype].itemsize < DTYPES[need].itemsize:
            raise _refuse(
                tf.path,
                f"its tokens are {tf.dtype}, which cannot hold the tokenizer's "
                f"{info.vocab_size} ids",
            )
    dtype = found[0].dtype
    if any(tf.dtype != dtype for tf in found):
        raise _refuse(found[1].path, f"its tokens are not {dtype}, as {found[0].path.name}'s")
    maps = [np.memmap(tf.path, dtype=DTYPES[dtype], mode="r", shape=(tf.tokens,)) for tf in found]
    tokens = ShardedTokens(maps)
    offsets = np.cumsum([0] + [tf.tokens for tf in found])
    doc_offsets = np.concatenate([tf.doc_starts + offsets[k] for k, tf in enumerate(found)])
    ends = np.append(doc_offsets[1:], tokens.size) - 1
    last = tokens.take(ends)
    bad = np.flatnonzero(last != info.eos_id)
    if bad.size:
        d = int(bad[0])
        k = int(np.searchsorted(offsets, doc_offsets[d], side="right") - 1)
        first = d - int(np.searchsorted(doc_offsets, offsets[k]))
        raise _refuse(
            found[k].path,
            f"{bad.size} documents do not end with the tokenizer's EOS id {info.eos_id} (the "
            f"first: its document {first}, which ends with {int(last[d])}); Zephon's "
            "samples need it (Megatron-LM: preprocess_data.py --append-eod)",
        )
    sums, maxima = content_checksums(tokens)
    top = int(maxima.max())
    if top >= info.vocab_size:
        chunk = int(np.argmax(maxima))
        k = int(np.searchsorted(offsets, chunk * (1 << 16), side="right") - 1)
        raise _refuse(
            found[k].path,
            f"token id {top} is outside the tokenizer's vocabulary of {info.vocab_size} ids",
        )
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    (tmp / DOC_OFFSETS).write_bytes(doc_offsets.astype("<i8").tobytes())
    (tmp / CHECKSUMS).write_bytes(sums.tobytes())
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": {
            "sha256": info.sha256,
            "vocab_size": info.vocab_size,
            "eos_token": info.eos_token,
        },
        "dtype": dtype,
        "eos_id": info.eos_id,
        "num_tokens": int(tokens.size),
        "num_documents": int(doc_offsets.size),
        "sources": [_source_record(tf) for tf in found],
        "content": content_section(tmp, top),
    }
    manifest["fingerprint"] = manifest_fingerprint(manifest)
    write_shard_list(
        tmp,
        manifest["fingerprint"],
        [tf.tokens for tf in found],
        [str(tf.path.resolve()) for tf in found],
    )
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.rename(tmp, out)
    return TokenStore.open(out)


def _source_record(tf: TokenFile) -> dict[str, Any]:
    """The manifest's record of a token file: its name, kind, sha256 and size."""
    h = hashlib.sha256()
    with open(tf.path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {
        "name": tf.path.name,
        "kind": tf.kind,
        "sha256": h.hexdigest(),
        "size": tf.path.stat().st_size,
    }
