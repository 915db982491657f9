"""Corpora already tokenized, read in place: Megatron-LM indexed datasets and OLMo's
numpy token files registered as a store (``zephon prepare FILES --input-format
megatron|numpy --tokenizer DIR --output STORE``).

Role: a corpus of 15 T tokens is tokenized once, by the framework that wrote it;
tokenizing it again would cost ~5,500 core-hours. Registering reads every token once,
in one pass (``_scan``: content checksums, the largest id, document ends, each file's
sha256) and writes only metadata into the store: the manifest, ``doc_offsets.bin`` (8
bytes a document), ``checksums.bin`` (8 bytes per 65,536 tokens) and ``shards.json``
naming the token files where they are (``store.shards``: each file one shard, read in
place). The tokens are never copied. Local files make a local store; objects of one
bucket (URLs, or a glob pattern of them) make a store in that bucket (``--output
s3://bucket/prefix``), which names them by URL and reads them by range from the
bucket's root (``store.location``): the files are read by range, pinned to the ETag
they had when first looked at, and looked at again before anything is written (one
that changed meanwhile is refused, naming it).

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
import posixpath
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.ingest.input_file import GLOB_CHARS
from torchtitan_zephon.ingest.objects import check_output, list_inputs, upload_store
from torchtitan_zephon.ingest.tokenizer import dtype_for_vocab, load_tokenizer_info
from torchtitan_zephon.store.format import (
    CHECKSUMS,
    DOC_OFFSETS,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    StoreError,
    check_block_tokens,
    content_checksums,
    content_section,
    manifest_fingerprint,
    num_blocks,
)
from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.object_faults import MissingObject
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import ShardedTokens, write_shard_list
from torchtitan_zephon.store.urls import ObjectURL, is_url, parse_url, redact
from torchtitan_zephon.store.writer import create_block_file, write_block_info, write_block_range

INPUT_FORMATS = ("text", "megatron", "numpy")
"""``zephon prepare --input-format``: text to tokenize (the default), or token files."""
MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {8: "uint16", 4: "uint32"}  # int32 read as uint32: the same bytes
SCAN_TOKENS = 1 << 24
"""Tokens read at a time when a file is scanned (bounded memory for any file size; a
whole number of checksum chunks)."""
JOINED = "token files"
"""The token files in a bucket, read as one file by the scan (``ObjectFiles.join``)."""


class TokenPlace:
    """Where the token files of one registration are: local paths, or objects of one
    bucket (``bucket``: read by range from the bucket's root, ``store.location``, each
    pinned to the ETag it had when first looked at). A file is named by its absolute
    path, or by ``/key``."""

    def __init__(self, bucket: ObjectURL | None = None) -> None:
        self.url = bucket
        self.files = None if bucket is None else ObjectFiles(bucket)

    def name(self, value: str) -> str:
        if self.url is None:
            return os.path.abspath(value)
        found = parse_url(value, "a token file", pattern=True)
        assert isinstance(found, ObjectURL)
        return "/" + found.prefix

    def shown(self, name: str) -> str:
        return name if self.url is None else self.url.child(name)

    def exists(self, name: str) -> bool:
        if self.files is None:
            return Path(name).is_file()
        try:
            self.files.open_file(name)
        except MissingObject:
            return False
        return True

    def size(self, name: str) -> int:
        if self.files is None:
            return Path(name).stat().st_size
        return self.files.sizes.get(name) or self.files.open_file(name)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> bytes:
        stop = self.size(name) if stop is None else stop
        if stop <= start:
            return b""
        if self.files is None:
            with open(name, "rb") as f:
                f.seek(start)
                return f.read(stop - start)
        return bytes(self.files.submit(name, [start], [stop], urgent=True).result()[0])

    def changed(self, names: list[str]) -> str | None:
        """The first of ``names`` whose object is no longer the one read (its ETag or size
        changed since it was first looked at); None when all are (local files: None)."""
        if self.files is None or self.url is None:
            return None
        fresh = ObjectFiles(self.url)
        try:
            for name in names:
                try:
                    size = fresh.open_file(name)
                except MissingObject:
                    return name
                if fresh.etags.get(name) != self.files.etags.get(name) or size != self.size(name):
                    return name
        finally:
            fresh.close()
        return None

    def close(self) -> None:
        if self.files is not None:
            self.files.close()


@dataclass
class TokenFile:
    """One token file read in place: its name (``TokenPlace``), as messages show it, the
    dtype of its tokens, their count and the first token of each of its documents (from
    0, within the file; None for a numpy file until the scan finds its EOS tokens)."""

    name: str
    path: str
    kind: str
    dtype: str
    tokens: int
    doc_starts: np.ndarray | None


def _refuse(path: str | Path, what: str) -> StoreError:
    return StoreError(f"{path}: {what}; nothing was written.")


def read_megatron(place: TokenPlace, value: str) -> TokenFile:
    """The ``.bin`` of the Megatron-LM indexed dataset ``value`` (a prefix, or its ``.bin``
    or ``.idx``), its documents from its ``.idx``, checked against each other."""
    base = value[:-4] if value.endswith((".bin", ".idx")) else value
    binary, index = place.name(base + ".bin"), place.name(base + ".idx")
    for p in (binary, index):
        if not place.exists(p):
            raise _refuse(
                place.shown(p), "not found: a Megatron-LM indexed dataset is a .bin and its .idx"
            )
    shown = place.shown(index)
    data = place.read(index)
    head = len(MEGATRON_HEADER) + 8 + 1 + 8 + 8
    if len(data) < head or not data.startswith(MEGATRON_HEADER):
        raise _refuse(
            shown,
            f"not a Megatron-LM index (expected the header {MEGATRON_HEADER!r} of "
            "MMapIndexedDataset)",
        )
    version, code, sequences, documents = struct.unpack_from("<QBQQ", data, len(MEGATRON_HEADER))
    if version != 1:
        raise _refuse(shown, f"Megatron-LM index version {version}; Zephon reads version 1")
    if code not in MEGATRON_DTYPES:
        raise _refuse(
            shown,
            f"token dtype code {code}; Zephon reads uint16 (code 8) and int32 (code 4) tokens",
        )
    need = head + sequences * (4 + 8) + documents * 8
    if len(data) < need:
        raise _refuse(
            shown, f"truncated: {len(data)} bytes for {sequences} sequences and {documents} "
            f"document indices ({need} bytes)"
        )  # fmt: skip
    lengths = np.frombuffer(data, "<i4", sequences, head).astype(np.int64)
    pointers = np.frombuffer(data, "<i8", sequences, head + sequences * 4)
    indices = np.frombuffer(data, "<i8", documents, head + sequences * 12)
    dtype = MEGATRON_DTYPES[code]
    item = DTYPES[dtype].itemsize
    size = place.size(binary)
    starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum()) if sequences else 0
    if (lengths < 0).any() or not np.array_equal(pointers, starts * item) or total * item != size:
        raise _refuse(
            shown,
            f"its counts disagree with {posixpath.basename(binary)} ({size} bytes: "
            f"{size // item} tokens of {dtype}; the index holds {sequences} sequences of "
            f"{total} tokens, which must lie back to back from byte 0)",
        )
    if documents < 2 or indices[0] != 0 or indices[-1] != sequences or (np.diff(indices) < 1).any():
        raise _refuse(
            shown,
            "its document indices must run from 0 to the sequence count, each document "
            "at least one sequence",
        )
    doc_starts = starts[indices[:-1]]
    ends = np.append(doc_starts[1:], total)
    if (ends - doc_starts < 1).any():
        raise _refuse(shown, "a document holds no token")
    return TokenFile(
        binary, place.shown(binary), "megatron", dtype, total, doc_starts.astype(np.int64)
    )


def read_numpy(place: TokenPlace, value: str, dtype: str, eos_id: int) -> TokenFile:
    """The OLMo token file ``value`` (a raw array of ``dtype``): its size and ends
    checked; its documents (each ended by ``eos_id``) are found by the scan."""
    name = place.name(value)
    shown = place.shown(name)
    if not place.exists(name):
        raise _refuse(shown, "not found")
    if place.read(name, 0, 6) == b"\x93NUMPY":
        raise _refuse(
            shown,
            "an .npy file with a header; OLMo's token files are raw arrays (np.memmap): "
            "write the array with tofile(), or pass its raw data",
        )
    item = DTYPES[dtype].itemsize
    size = place.size(name)
    if size == 0 or size % item:
        raise _refuse(
            shown, f"{size} bytes is not a whole number of {dtype} tokens (the tokenizer's dtype)"
        )
    last = int(np.frombuffer(place.read(name, size - item, size), dtype=DTYPES[dtype])[0])
    if last != eos_id:
        raise _refuse(
            shown,
            f"its last token is {last}, not the tokenizer's EOS {eos_id}: OLMo's "
            "token files end every document with EOS (is it the tokenizer the file was "
            "written with?)",
        )
    return TokenFile(name, shown, "numpy", dtype, size // item, None)


def _where(files: list[str], output: str) -> tuple[ObjectURL | None, ObjectURL | None]:
    """(the bucket of the token files, the output's URL): both None for local files into
    a local store; a StoreError for any other mix."""
    urls = [f for f in files if is_url(f)]
    if not urls:
        if is_url(output):
            raise StoreError(
                f"--output {redact(output)}: token files on local disk are registered into a "
                "local store, read where they are; upload the files and register them in "
                "their bucket (INPUTs as URLs), or choose a local --output. Nothing was "
                "written."
            )
        return None, None
    if len(urls) != len(files):
        raise StoreError(
            f"the token files mix URLs and local paths ({redact(urls[0])}, ...); a store reads "
            "its token files in one place: all local, or all in one bucket. Nothing was "
            "written."
        )
    found = [parse_url(f, "a token file", pattern=True) for f in urls]
    first = found[0]
    assert isinstance(first, ObjectURL)
    other = next((f for f in found if (f.scheme, f.bucket) != (first.scheme, first.bucket)), None)  # type: ignore[union-attr]
    if other is not None:
        raise StoreError(
            f"the token files lie in more than one bucket ({first.scheme}://{first.bucket}, "
            f"{other.scheme}://{other.bucket}); a store reads its token files in place in "  # type: ignore[union-attr]
            "one bucket. Nothing was written."
        )
    out = parse_url(output, "--output") if is_url(output) else None
    if not isinstance(out, ObjectURL) or (out.scheme, out.bucket) != (first.scheme, first.bucket):
        raise StoreError(
            f"the token files are objects of {first.scheme}://{first.bucket}: the store that "
            f"reads them in place lives in that bucket too (--output "
            f"{first.scheme}://{first.bucket}/PREFIX), not at {redact(output)}. Nothing was "
            "written."
        )
    root = ObjectURL(first.scheme, first.bucket, "", first.root_text())
    return root, out


def _expand(place: TokenPlace, values: list[str], input_format: str) -> list[str]:
    """The token files ``values`` name: local paths as given; in a bucket, each URL, or
    each object of a glob pattern (a Megatron dataset by its ``.bin``), in key order."""
    if place.url is None:
        return values
    out: list[str] = []
    for value in values:
        if not any(c in value for c in GLOB_CHARS):
            out.append(value)
            continue
        with tempfile.TemporaryDirectory() as spool:  # nothing is spooled: listed only
            listed = [src.remote for _, src in list_inputs(value, Path(spool))]
        keys = [f"{o.prefix}/{o.name}" if o.prefix else o.name for o in listed if o is not None]
        if input_format == "megatron":
            keys = [k for k in keys if k.endswith(".bin")]
        out.extend(place.url.key_url(k) for k in keys)
    return out


def _scan(
    place: TokenPlace, found: list[TokenFile], dtype: str, eos_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """One pass over every token, ``SCAN_TOKENS`` at a time: (content checksums, the
    largest id of each chunk, the documents' first tokens, each file's sha256). A numpy
    file's documents are found here (each ends at an EOS); a Megatron document that does
    not end with EOS is refused, naming its file."""
    bounds = np.cumsum([0] + [tf.tokens for tf in found]).astype(np.int64)
    total = int(bounds[-1])
    tokens = _Tokens(place, found, dtype)

    def window(a: int, b: int) -> np.ndarray:
        return tokens[a:b]

    known = [tf.doc_starts + bounds[k] for k, tf in enumerate(found) if tf.doc_starts is not None]
    ends = (  # the last token of each Megatron document (global), ascending
        np.concatenate([np.append(s[1:], bounds[k + 1]) - 1 for k, s in zip(
            [k for k, tf in enumerate(found) if tf.doc_starts is not None], known, strict=True
        )]) if known else np.zeros(0, np.int64)
    )  # fmt: skip
    hashers = [hashlib.sha256() for _ in found]
    eos: list[list[np.ndarray]] = [[] for _ in found]
    sums, maxima, bad = [], [], []
    for a in range(0, total, SCAN_TOKENS):
        b = min(total, a + SCAN_TOKENS)
        w = window(a, b)
        s, m = content_checksums(w)
        sums.append(s)
        maxima.append(m)
        first = int(np.searchsorted(bounds, a, side="right")) - 1
        for k in range(first, len(found)):
            lo, hi = max(a, int(bounds[k])), min(b, int(bounds[k + 1]))
            if lo >= hi:
                break
            part = w[lo - a : hi - a]
            hashers[k].update(np.ascontiguousarray(part))  # no copy: a view
            if found[k].doc_starts is None:
                eos[k].append(np.flatnonzero(part == eos_id) + lo)
        x, y = np.searchsorted(ends, [a, b])
        if y > x:
            at = ends[x:y]
            wrong = at[w[at - a] != eos_id]
            if wrong.size:
                bad.append(wrong)
    if bad:
        wrong = np.concatenate(bad)
        k = int(np.searchsorted(bounds, wrong[0], side="right")) - 1
        d = int(np.searchsorted(found[k].doc_starts + bounds[k], wrong[0], side="right")) - 1  # type: ignore[operator]
        last = int(window(int(wrong[0]), int(wrong[0]) + 1)[0])
        raise _refuse(
            found[k].path,
            f"{wrong.size} documents do not end with the tokenizer's EOS id {eos_id} (the "
            f"first: its document {d}, which ends with {last}); Zephon's samples need it "
            "(Megatron-LM: preprocess_data.py --append-eod)",
        )
    starts = []
    for k, tf in enumerate(found):
        if tf.doc_starts is not None:
            starts.append(tf.doc_starts + bounds[k])
        else:
            at = np.concatenate(eos[k])
            starts.append(np.concatenate([[bounds[k]], at[:-1] + 1]).astype(np.int64))
    return (
        np.concatenate(sums) if sums else np.zeros(0, "<u8"),
        np.concatenate(maxima) if maxima else np.zeros(0, np.int64),
        np.concatenate(starts),
        [h.hexdigest() for h in hashers],
    )


def register_store(
    files: list[str],
    input_format: str,
    tokenizer: str,
    output: str,
    *,
    block_tokens: int | None = None,
) -> TokenStore:
    """A store at ``output`` over the token files ``files`` (``input_format`` "megatron"
    or "numpy"), read in place: local files into a local store, or objects of one bucket
    into a store in that bucket (see the module docstring); opened. ``block_tokens``:
    block checksums of that many tokens too (blocks.bin, 8 bytes a block: a second pass
    over the tokens, since they are seeded by the fingerprint), so that a job reading
    windows from a bucket fetches about what it trains; None: none."""
    if input_format not in ("megatron", "numpy"):
        raise StoreError(
            f"input format {input_format!r}: expected one of megatron, numpy (text is "
            "tokenized by zephon prepare)."
        )
    if not files:
        raise StoreError("no token files given; nothing was written.")
    bucket, out_url = _where(files, output)
    out = Path(os.path.abspath(output)) if out_url is None else None
    if out is not None and out.exists():
        raise StoreError(f"output {out} already exists; choose another path; nothing was written.")
    if out_url is not None:
        check_output(out_url)
    info = load_tokenizer_info(tokenizer)
    need = dtype_for_vocab(info.vocab_size)
    if block_tokens is not None:
        block_tokens = check_block_tokens(block_tokens, "--block-tokens")
    place = TokenPlace(bucket)
    try:
        named = _expand(place, files, input_format)
        if input_format == "megatron":
            found = [read_megatron(place, f) for f in named]
        else:
            found = [read_numpy(place, f, need, info.eos_id) for f in named]
        for tf in found:
            if DTYPES[tf.dtype].itemsize < DTYPES[need].itemsize:
                raise _refuse(
                    tf.path,
                    f"its tokens are {tf.dtype}, which cannot hold the tokenizer's "
                    f"{info.vocab_size} ids",
                )
        dtype = found[0].dtype
        if any(tf.dtype != dtype for tf in found):
            raise _refuse(
                found[1].path,
                f"its tokens are not {dtype}, as {posixpath.basename(found[0].path)}'s",
            )
        sums, maxima, doc_offsets, digests = _scan(place, found, dtype, info.eos_id)
        top = int(maxima.max())
        if top >= info.vocab_size:
            chunk = int(np.argmax(maxima))
            bounds = np.cumsum([0] + [tf.tokens for tf in found])
            k = int(np.searchsorted(bounds, chunk * (1 << 16), side="right") - 1)
            raise _refuse(
                found[k].path,
                f"token id {top} is outside the tokenizer's vocabulary of {info.vocab_size} ids",
            )
        parent = out.parent if out is not None else Path(tempfile.mkdtemp(prefix="zephon-reg-"))
        name = out.name if out is not None else "store"
        tmp = parent / f".{name}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            manifest = _write_metadata(tmp, info, found, dtype, sums, top, doc_offsets, digests)
            if block_tokens is not None:
                _write_blocks(tmp, place, found, dtype, manifest["fingerprint"], block_tokens)
            moved = place.changed([tf.name for tf in found])
            if moved is not None:
                raise _refuse(
                    place.shown(moved),
                    "changed while it was registered (its ETag or size is not the one "
                    "read); register the files again once they stay put",
                )
            where = [tf.name if bucket is None else bucket.key_url(tf.name) for tf in found]
            write_shard_list(tmp, manifest["fingerprint"], [tf.tokens for tf in found], where)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if out is not None:
                os.rename(tmp, out)
            else:
                assert out_url is not None
                upload_store(tmp, out_url)  # manifest.json last
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if out is None:
                shutil.rmtree(parent, ignore_errors=True)
    finally:
        place.close()
    return TokenStore.open(out if out is not None else output)


def _write_metadata(
    tmp: Path,
    info: Any,
    found: list[TokenFile],
    dtype: str,
    sums: np.ndarray,
    top: int,
    doc_offsets: np.ndarray,
    digests: list[str],
) -> dict[str, Any]:
    """doc_offsets.bin and checksums.bin into ``tmp``; the manifest (not written yet)."""
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
        "num_tokens": int(sum(tf.tokens for tf in found)),
        "num_documents": int(doc_offsets.size),
        "sources": [
            {
                "name": posixpath.basename(tf.name),
                "kind": tf.kind,
                "sha256": digest,
                "size": tf.tokens * DTYPES[dtype].itemsize,
            }
            for tf, digest in zip(found, digests, strict=True)
        ],
        "content": content_section(tmp, top),
    }
    manifest["fingerprint"] = manifest_fingerprint(manifest)
    return manifest


def _write_blocks(
    tmp: Path,
    place: TokenPlace,
    found: list[TokenFile],
    dtype: str,
    fingerprint: str,
    block_tokens: int,
) -> None:
    """blocks.bin and blocks.json of ``block_tokens`` into ``tmp``: a second pass over the
    tokens (block checksums are seeded by the fingerprint, known after the first)."""
    tokens = _Tokens(place, found, dtype)
    total = tokens.size
    create_block_file(tmp, total, block_tokens)
    per = max(1, SCAN_TOKENS // block_tokens)
    count = num_blocks(total, block_tokens)
    for first in range(0, count, per):
        write_block_range(tmp, tokens, fingerprint, first, min(count, first + per), block_tokens)  # type: ignore[arg-type]
    write_block_info(tmp, fingerprint, total, block_tokens)


class _Tokens:
    """The token files read as one array by slice (``SCAN_TOKENS`` or a batch of blocks at
    a time): local maps, or ranges of the objects joined."""

    def __init__(self, place: TokenPlace, found: list[TokenFile], dtype: str) -> None:
        self.place, self.dtype = place, DTYPES[dtype]
        self.size = int(sum(tf.tokens for tf in found))
        self._local: ShardedTokens | None = None
        if place.files is None:
            self._local = ShardedTokens(
                [np.memmap(tf.name, dtype=self.dtype, mode="r", shape=(tf.tokens,)) for tf in found]
            )
        else:
            place.files.join(JOINED, [(tf.name, tf.tokens * self.dtype.itemsize) for tf in found])

    def __getitem__(self, key: slice) -> np.ndarray:
        a, b, _ = key.indices(self.size)
        if self._local is not None:
            return np.asarray(self._local[a:b])
        if b <= a:
            return np.zeros(0, dtype=self.dtype)
        item = self.dtype.itemsize
        assert self.place.files is not None
        data = self.place.files.submit(JOINED, [a * item], [b * item], urgent=True).result()[0]
        return np.frombuffer(data, dtype=self.dtype)
