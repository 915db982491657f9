"""The token store's format: file names, manifest, fingerprints and checksums.

Role: what a store is on disk, in one place, for the reader, the writers
(``zephon prepare``, ``upgrade``, test slices) and everything that names a store
(``is_store``, the cache). Also the one definition of "the bytes of a JSON value"
(``canonical_json``) for everything that fingerprints one (store manifests, data
configs, sequence-log records), so two modules can never disagree about a
fingerprint because they serialised a dict differently.

Invariants:
- ``canonical_json(x) == canonical_json(y)`` exactly when ``x`` and ``y`` are
  equal JSON values (keys sorted, no whitespace, ASCII only), and
  ``fingerprint`` is the hex sha256 of those bytes.
- ``manifest_fingerprint`` hashes the whole manifest but its ``fingerprint``
  field; for a version-2 store that includes the content section, so two such
  stores with the same fingerprint serve the same samples.
- Chunk ``c`` of a store's tokens is ``tokens[c * chunk_tokens : (c + 1) *
  chunk_tokens]`` (the last may be short); its checksum is the xxh3-64 of its
  little-endian bytes (``content_checksums``), and checksums.bin holds them in
  chunk order.

Layout on disk::

    <store>/manifest.json    format, tokenizer, dtype, counts, sources, content, fingerprint
    <store>/tokens.bin       num_tokens tokens, little-endian uint16 or uint32
    <store>/doc_offsets.bin  num_documents int64 start offsets, one per document
    <store>/checksums.bin    one little-endian uint64 xxh3-64 per chunk of tokens.bin
    <store>/content.json     only in a version-1 store upgraded in place: its content section
    <store>/blocks.bin       optional (prepare, ``inspect --upgrade``): one uint64 per block
    <store>/blocks.json      optional, written after blocks.bin: what blocks.bin is (below)

A sharded store (``shards``) holds its tokens in ``<store>/tokens/000000.bin``, ... and
lists them in ``<store>/shards.json`` instead of tokens.bin; its other files, the
manifest included, are those of the one-file store of the same tokens.

The content section: ``algorithm`` ("xxh3_64"), ``chunk_tokens``,
``checksums_xxh3_128`` (of checksums.bin), ``doc_offsets_xxh3_128`` (checked by
``check`` only: training does not read document offsets) and ``max_token_id``.

Block checksums (the finer check level, for stores read by range from object storage):
with ``B`` the store's ``block_tokens`` (chosen when the blocks are written: ``zephon
prepare --block-tokens B``, ``zephon inspect STORE --upgrade --block-tokens B``; default
``BLOCK_TOKENS`` = 512; an integer in [1, ``MAX_BLOCK_TOKENS``]), block ``b`` is
``tokens[b * B : (b + 1) * B + 1]`` (B tokens and the next block's first: blocks overlap
by one token); the last block ends at the last token; a store of ``n`` tokens has
``max(1, ceil((n - 1) / B))`` blocks. Its checksum is the xxh3-64 of its little-endian
bytes with the seed ``block_seed(fingerprint)`` (the first 16 hex digits of the store's
fingerprint), and blocks.bin holds them in block order, little-endian uint64. blocks.json
(``block_section``) records the format, ``block_tokens``, the algorithm, the store's
fingerprint, ``num_blocks`` and ``blocks_xxh3_128`` (of blocks.bin, checked by
``check``). Neither file is part of the manifest, so adding or rewriting them (any
``B``) leaves the fingerprint, and every checkpoint and sequence log that names it,
unchanged.

The rule for choosing ``B``: pick ``B = seq_len`` or a divisor of it. Sample ``i`` is
the window ``tokens[i * seq_len : i * seq_len + seq_len + 1]``; when ``B`` divides
``seq_len`` it starts on a block boundary and is exactly ``seq_len / B`` blocks, its
label token the last block's overlap, so a read by range fetches exactly its own tokens
(plus 8 bytes of checksum per block). Otherwise reads round out to whole blocks: a
window of 129 tokens (seq_len 128) read from 512-token blocks fetches 513 tokens.
Smaller ``B`` means a larger blocks.bin (8 bytes per ``B`` tokens: 6 % of tokens.bin at
``B`` = 64 with uint16 tokens).

How block checksums are trusted, without reading a checksum file whole: blocks.json must
name the fingerprint of the manifest beside it (a stale or foreign one is refused at
open), and every block checksum is seeded with that fingerprint, which covers the
content section and so, through checksums.bin, every token: a blocks.bin written for
another store (or another version of this one) fails on the first block read.
``upgrade`` writes block checksums only from tokens that matched every chunk checksum.
A corrupt blocks.bin or tokens.bin is a mismatch, i.e. a stop, never a silent use;
only someone rewriting tokens.bin and blocks.bin together on purpose gets past it, the
boundary the chunk checksums already have (a forger rewriting checksums.bin and the
manifest).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

FORMAT = "zephon-token-store"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
DOC_OFFSETS = "doc_offsets.bin"
CHECKSUMS = "checksums.bin"
CONTENT = "content.json"
CHUNK_TOKENS = 1 << 16
CHECKSUM_ALGORITHM = "xxh3_64"
BLOCKS = "blocks.bin"
BLOCKS_INFO = "blocks.json"
BLOCKS_FORMAT = "zephon-block-checksums"
SHARDS = "shards.json"
"""A sharded store's list of shards (``shards``), in place of tokens.bin."""
SHARD_FOLDER = "tokens"
"""The folder of a sharded store's shard files."""
BLOCK_TOKENS = 512
"""The default ``block_tokens``: tokens a block checksum covers (plus the next block's
first: blocks overlap by one); a store records its own in blocks.json."""
MAX_BLOCK_TOKENS = CHUNK_TOKENS
"""The largest ``block_tokens`` (a chunk: beyond it, blocks check no finer than chunks)."""
BUILTIN_PREFIX = "builtin:"
"""A store value starting with this names a part of the builtin corpus (``ingest.builtin``),
not a path."""
STORE_FILES = (TOKENS, DOC_OFFSETS, CHECKSUMS, CONTENT, BLOCKS, BLOCKS_INFO, SHARDS, MANIFEST)
"""Every file a store may hold at its top (a sharded store's shard files are under
``SHARD_FOLDER``, written before shards.json), the manifest last: the order a copy writes
them in (a copy cut before its manifest is no store)."""

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
REPREPARE = "Re-run `zephon prepare` to rebuild the store."


class StoreError(ValueError):
    """A token store (or the input to build one) is missing, incomplete or invalid."""


class DataUnreadable(StoreError):
    """A read of the store failed while ``what`` was read (the loader: "the data of step
    S"; the validator: "the held-out samples of the validation at step S"); ``kind`` is
    the failed read's error as a user is shown it (``error_kind``), the message its own."""

    def __init__(self, error: BaseException, step: int, what: str) -> None:
        super().__init__(str(error))
        self.step, self.what, self.kind = step, what, error_kind(error)


def error_kind(error: BaseException) -> str:
    """The name of ``error``'s class as messages show it: the first public one of its
    classes (an internal ``_Unanswered`` reads as ``StoreError``)."""
    for cls in type(error).__mro__:
        if not cls.__name__.startswith("_"):
            return cls.__name__
    return "Error"


class UncheckedStoreWarning(UserWarning):
    """A store without content checksums (format version 1) was opened: its reads are unchecked."""


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, ASCII only: the same value always gives the same bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def fingerprint(value: Any) -> str:
    """Hex sha256 of ``canonical_json(value)``."""
    return hashlib.sha256(canonical_json(value)).hexdigest()


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """Hex sha256 of the canonical JSON of ``manifest`` without its ``fingerprint`` field."""
    body = {k: v for k, v in manifest.items() if k != "fingerprint"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def is_store(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding a token store manifest."""
    p = Path(path)
    if not (p / MANIFEST).is_file():
        return False
    try:
        return json.loads((p / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError, RecursionError):  # Recursion: deep JSON
        return False


def map_file(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """Memory-map ``count`` values of ``dtype`` from ``path`` read-only, checking its size."""
    if not path.is_file():
        raise StoreError(f"store file {str(path)!r} is missing. {REPREPARE}")
    check_file_size(str(path), path.stat().st_size, dtype, count)
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def check_file_size(shown: str, actual: int, dtype: np.dtype, count: int) -> None:
    """Refuse a store file (``shown`` as messages print it) of ``actual`` bytes that should
    hold ``count`` values of ``dtype``: empty, truncated or too long."""
    expected = count * dtype.itemsize
    if actual != expected:
        state = "empty" if actual == 0 else ("truncated" if actual < expected else "too long")
        raise StoreError(
            f"store file {shown!r} is {state}: expected {expected} bytes "
            f"({count} x {dtype.name}), found {actual}. {REPREPARE}"
        )


# ----------------------------------------------------------------------------- checksums


def content_checksums(
    tokens: np.ndarray, chunk_tokens: int = CHUNK_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """(xxh3-64 of each chunk's little-endian bytes as uint64, max token id of each chunk).

    Chunk ``c`` is ``tokens[c * chunk_tokens : (c + 1) * chunk_tokens]``; the last may be short.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}.")
    if isinstance(tokens, np.ndarray):  # else a store's shards (``shards.ShardedTokens``)
        tokens = np.ascontiguousarray(tokens)
    n = -(-tokens.size // chunk_tokens)
    sums = np.empty(n, dtype="<u8")
    maxima = np.empty(n, dtype=np.int64)
    for c in range(n):
        chunk = np.ascontiguousarray(tokens[c * chunk_tokens : (c + 1) * chunk_tokens])
        sums[c] = xxhash.xxh3_64_intdigest(chunk)
        maxima[c] = int(chunk.max())
    return sums, maxima


def file_xxh3_128(path: Path) -> str:
    """Hex xxh3-128 of the whole file at ``path`` (the content section's file hashes)."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def num_chunks(num_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """How many checksum chunks cover ``num_tokens`` tokens (the last may be short)."""
    return -(-num_tokens // chunk_tokens)


def content_section(
    store_dir: str | os.PathLike, max_token_id: int, chunk_tokens: int = CHUNK_TOKENS
) -> dict[str, Any]:
    """The manifest's ``content`` section of the store files in ``store_dir``, whose
    ``checksums.bin`` is complete and whose largest token id is ``max_token_id``."""
    root = Path(store_dir)
    hashes = (file_xxh3_128(root / CHECKSUMS), file_xxh3_128(root / DOC_OFFSETS))
    return content_fields(max_token_id, chunk_tokens, hashes)


def content_fields(max_token_id: int, chunk_tokens: int, hashes: tuple[str, str]) -> dict[str, Any]:
    """The content section of a store whose checksums.bin and doc_offsets.bin hash
    (xxh3-128) to ``hashes``."""
    return {
        "algorithm": CHECKSUM_ALGORITHM,
        "chunk_tokens": int(chunk_tokens),
        "checksums_xxh3_128": hashes[0],
        "doc_offsets_xxh3_128": hashes[1],
        "max_token_id": int(max_token_id),
    }


def check_block_tokens(value: Any, what: str = "block_tokens") -> int:
    """``value`` as a block size (an integer in [1, ``MAX_BLOCK_TOKENS``]), or a StoreError
    naming ``what`` (how the caller spells the setting), the range and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        found = repr(value)
    elif 1 <= int(value) <= MAX_BLOCK_TOKENS:
        return int(value)
    else:
        found = str(int(value))
    raise StoreError(
        f"{what} must be an integer in [1, {MAX_BLOCK_TOKENS}] (tokens per block checksum; "
        f"pick seq_len or a divisor of it), got {found}; nothing was written."
    )


def num_blocks(num_tokens: int, block_tokens: int) -> int:
    """How many block checksums of ``block_tokens`` cover ``num_tokens`` tokens (see the
    module docstring)."""
    return max(1, -(-(num_tokens - 1) // block_tokens))


def block_seed(store_fingerprint: str) -> int:
    """The xxh3-64 seed of a store's block checksums: its fingerprint's first 64 bits."""
    return int(store_fingerprint[:16], 16)


def block_span(block: int, num_tokens: int, block_tokens: int) -> tuple[int, int]:
    """Tokens [start, stop) of block ``block`` (overlapping the next block by one)."""
    start = block * block_tokens
    return start, min(start + block_tokens + 1, num_tokens)


def block_checksums(tokens: np.ndarray, seed: int, block_tokens: int) -> np.ndarray:
    """The checksums (uint64) of the blocks of ``block_tokens`` of ``tokens``: a store's
    tokens from a block's start to a block's end or the store's end (a store's whole
    tokens, or a range read)."""
    if isinstance(tokens, np.ndarray):  # else a store's shards (``shards.ShardedTokens``)
        tokens = np.ascontiguousarray(tokens)
    n = max(1, -(-(tokens.size - 1) // block_tokens)) if tokens.size else 0
    sums = np.empty(n, dtype="<u8")
    digest = xxhash.xxh3_64_intdigest
    for b in range(n):
        lo = b * block_tokens
        sums[b] = digest(np.ascontiguousarray(tokens[lo : lo + block_tokens + 1]), seed)
    return sums


def block_section(
    fingerprint_: str, num_tokens: int, blocks_file: Path, block_tokens: int
) -> dict[str, Any]:
    """The content of blocks.json for the complete ``blocks_file`` (blocks of
    ``block_tokens``) of the store whose fingerprint is ``fingerprint_``."""
    return block_fields(fingerprint_, num_tokens, block_tokens, file_xxh3_128(blocks_file))


def block_fields(
    fingerprint_: str, num_tokens: int, block_tokens: int, blocks_hash: str
) -> dict[str, Any]:
    """blocks.json of a store (``block_section``) whose blocks.bin hashes to ``blocks_hash``."""
    return {
        "format": BLOCKS_FORMAT,
        "version": 1,
        "algorithm": CHECKSUM_ALGORITHM,
        "block_tokens": int(block_tokens),
        "seed": "fingerprint[:16]",
        "fingerprint": fingerprint_,
        "num_blocks": num_blocks(num_tokens, block_tokens),
        "blocks_xxh3_128": blocks_hash,
    }


@dataclass
class ContentReport:
    """Result of ``TokenStore.check``: each finding, and the chunks whose checksum differs."""

    chunks: int
    chunk_tokens: int | None
    max_token_id: int | None  # the largest id actually found
    bad_chunks: list[dict[str, int]] = field(default_factory=list)  # index, start, stop
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "chunks": self.chunks,
            "chunk_tokens": self.chunk_tokens,
            "max_token_id": self.max_token_id,
            "bad_chunks": self.bad_chunks,
            "problems": self.problems,
        }
