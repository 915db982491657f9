"""Writing store files: checksums, and stores derived from another's tokens.

Role: the writes a store's files need beyond prepare's token and offset files:
checksums.bin and the content section (whole, or a range of chunks per process),
blocks.bin and blocks.json (``format``'s block checksums: whole, or a range of
blocks per process; ``zephon prepare`` and ``migrate.old_stores.add_block_checksums`` both
write them here), a store built from tokens already prepared
(``write_derived_store``), a slice of a store's whole documents for tests and
benchmarks (``slice_store``), and a copy of a store with its tokens as one file or as
shards of another size (``write_store_as``, ``store.shards``).

Invariant: checksums depend only on the bytes of tokens.bin and doc_offsets.bin
(and ``chunk_tokens``): ``write_checksums`` and disjoint ``write_chunk_checksums``
ranges completed by ``format.content_section`` write the same bytes; block checksums
depend only on tokens.bin, the fingerprint and ``block_tokens`` (always passed
explicitly: no writer assumes a size): disjoint ``write_block_range`` ranges covering
``[0, num_blocks)`` write the bytes of one ``block_checksums`` call,
and blocks.json (``write_block_info``) is written after them, naming a complete
blocks.bin; every store written here opens with ``reader.TokenStore.open``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.store.format import (
    BLOCKS,
    BLOCKS_INFO,
    CHECKSUMS,
    CHUNK_TOKENS,
    CONTENT,
    DOC_OFFSETS,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TOKENS,
    StoreError,
    block_checksums,
    block_section,
    block_seed,
    content_checksums,
    content_section,
    manifest_fingerprint,
    map_file,
    num_blocks,
)
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.shards import shard_counts, write_shard_list, write_shards


def write_checksums(
    store_dir: str | os.PathLike, manifest: dict[str, Any], *, chunk_tokens: int = CHUNK_TOKENS
) -> dict[str, Any]:
    """Hash the token content of the store files in ``store_dir`` (as ``manifest`` describes
    them), write ``checksums.bin`` and return the manifest's ``content`` section.

    Depends only on the bytes of tokens.bin and doc_offsets.bin (and ``chunk_tokens``).
    """
    root = Path(store_dir)
    tokens = map_file(root / TOKENS, DTYPES[manifest["dtype"]], int(manifest["num_tokens"]))
    sums, maxima = content_checksums(tokens, chunk_tokens)
    tmp = root / f".{CHECKSUMS}.tmp"
    tmp.write_bytes(sums.tobytes())
    os.replace(tmp, root / CHECKSUMS)
    return content_section(root, int(maxima.max()) if maxima.size else -1, chunk_tokens)


def write_chunk_checksums(
    store_dir: str | os.PathLike,
    manifest: dict[str, Any],
    first: int,
    stop: int,
    *,
    chunk_tokens: int = CHUNK_TOKENS,
    tokens: Any = None,
) -> int:
    """Hash chunks ``[first, stop)`` of tokens.bin (or of ``tokens``: a sharded store's,
    ``shards.ShardedTokens``) and write their checksums at their place in
    ``checksums.bin``, which already has its final size (``num_chunks`` x 8 bytes);
    return the largest token id of these chunks (-1 for none).

    Several processes may each write a disjoint range: together they write the same
    bytes as ``write_checksums``, and ``content_section`` then completes the section.
    """
    root = Path(store_dir)
    if tokens is None:
        tokens = map_file(root / TOKENS, DTYPES[manifest["dtype"]], int(manifest["num_tokens"]))
    sums, maxima = content_checksums(
        tokens[first * chunk_tokens : stop * chunk_tokens], chunk_tokens
    )
    fd = os.open(root / CHECKSUMS, os.O_WRONLY)
    try:
        pwrite_all(fd, sums.tobytes(), first * 8)
    finally:
        os.close(fd)
    return int(maxima.max()) if maxima.size else -1


def create_block_file(store_dir: str | os.PathLike, num_tokens: int, block_tokens: int) -> None:
    """Create (or replace) blocks.bin at its final size (``num_blocks`` x 8 bytes, zeros)
    for the ``write_block_range`` calls that fill it with blocks of ``block_tokens``."""
    with open(Path(store_dir) / BLOCKS, "wb") as fh:
        fh.truncate(num_blocks(num_tokens, block_tokens) * 8)


def write_block_range(
    store_dir: str | os.PathLike,
    tokens: np.ndarray,
    fingerprint_: str,
    first: int,
    stop: int,
    block_tokens: int,
) -> None:
    """Compute the checksums of blocks ``[first, stop)`` (of ``block_tokens``) of the store
    whose tokens are ``tokens`` and fingerprint ``fingerprint_`` and write them at their
    place in blocks.bin (``create_block_file``). Reads only the tokens of those blocks (a
    block ends one token into the next: ``format``)."""
    if stop <= first:
        return
    lo = first * block_tokens
    hi = min(stop * block_tokens + 1, int(tokens.size))
    sums = block_checksums(tokens[lo:hi], block_seed(fingerprint_), block_tokens)
    fd = os.open(Path(store_dir) / BLOCKS, os.O_WRONLY)
    try:
        pwrite_all(fd, sums.tobytes(), first * 8)
    finally:
        os.close(fd)


def write_block_info(
    store_dir: str | os.PathLike, fingerprint_: str, num_tokens: int, block_tokens: int
) -> None:
    """Write blocks.json for the complete blocks.bin (blocks of ``block_tokens``) in
    ``store_dir`` (last: until then the store has no block checksums)."""
    root = Path(store_dir)
    info = block_section(fingerprint_, num_tokens, root / BLOCKS, block_tokens)
    tmp = root / f".{BLOCKS_INFO}.tmp"
    tmp.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, root / BLOCKS_INFO)


def write_block_checksums(
    store_dir: str | os.PathLike, tokens: np.ndarray, fingerprint_: str, block_tokens: int
) -> None:
    """blocks.bin then blocks.json of a store (blocks of ``block_tokens``), whole, in one
    process."""
    n = int(tokens.size)
    create_block_file(store_dir, n, block_tokens)
    write_block_range(store_dir, tokens, fingerprint_, 0, num_blocks(n, block_tokens), block_tokens)
    write_block_info(store_dir, fingerprint_, n, block_tokens)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset`` (``os.pwrite`` may write less)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_derived_store(
    folder: Path, like: TokenStore, blob: bytes, doc_offsets: np.ndarray, source: dict[str, Any]
) -> None:
    """Write a store into the existing folder ``folder`` from tokens already prepared:
    ``blob`` (tokens in ``like``'s dtype), its document starts, and the one manifest
    source record naming where they came from (sha256 and size added here); tokenizer,
    dtype and EOS are ``like``'s. Checksums and fingerprint are computed fresh."""
    (folder / TOKENS).write_bytes(blob)
    (folder / DOC_OFFSETS).write_bytes(np.asarray(doc_offsets).astype("<i8").tobytes())
    source = {**source, "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    manifest = derived_manifest(
        like.manifest, len(blob) // like.dtype.itemsize, int(np.asarray(doc_offsets).size), source
    )
    manifest["content"] = write_checksums(folder, manifest)
    manifest["fingerprint"] = manifest_fingerprint(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def derived_manifest(
    like: dict[str, Any], num_tokens: int, num_documents: int, source: dict[str, Any]
) -> dict[str, Any]:
    """The manifest, before its content section and fingerprint, of a store of tokens
    already prepared (``write_derived_store``): tokenizer, dtype and EOS are those of the
    manifest ``like``; ``source`` is its one source record."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": like["tokenizer"],
        "dtype": like["dtype"],
        "eos_id": like["eos_id"],
        "num_tokens": int(num_tokens),
        "num_documents": int(num_documents),
        "text_field": like.get("text_field", "text"),
        "sources": [source],
    }


def slice_store(source: TokenStore, start: int, stop: int, output: str | os.PathLike) -> TokenStore:
    """Write the whole documents of ``source`` that lie within tokens ``[start, stop)``
    as a store of their own (same tokenizer and dtype, fresh checksums) and open it.

    A mixture's sources for tests and benchmarks, built in milliseconds without
    tokenizing; the manifest names the slice (``sources``), so slices of different
    ranges or stores have different fingerprints.
    """
    start, stop = int(start), int(stop)
    offsets = np.asarray(source.doc_offsets, dtype=np.int64)
    ends = np.append(offsets[1:], source.num_tokens)
    inside = np.nonzero((offsets >= start) & (ends <= stop))[0]
    if not 0 <= start < stop <= source.num_tokens or not inside.size:
        raise StoreError(
            f"slice [{start}, {stop}) holds no whole document of the {source.num_tokens} "
            f"tokens of {str(source.path)!r}; give a wider range."
        )
    out = Path(output)
    if out.exists():
        raise StoreError(f"output {str(out)!r} already exists; choose another path.")
    start, stop = int(offsets[inside[0]]), int(ends[inside[-1]])
    inside = offsets[inside] - start
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    blob = np.asarray(source.tokens[start:stop]).tobytes()
    write_derived_store(
        tmp,
        source,
        blob,
        inside,
        {
            "name": f"tokens [{start}, {stop}) of store {source.fingerprint[:16]}",
            "kind": "slice",
            "slice_of": source.fingerprint,
            "start": start,
            "stop": stop,
        },
    )
    os.rename(tmp, out)
    return TokenStore.open(out)


COPY_TOKENS = 1 << 26
"""Tokens written per piece by ``write_store_as`` into one tokens.bin (bounded memory)."""


def write_store_as(
    store: TokenStore, output: str | os.PathLike, *, shard_tokens: int | None = None
) -> TokenStore:
    """Write the local store ``store`` again at ``output``, its tokens as one tokens.bin
    (``shard_tokens`` None) or as shards of ``shard_tokens`` tokens (the last shorter),
    and open it. Every other file is copied byte for byte, the manifest last: the copy
    has ``store``'s fingerprint, samples and order (``store.shards``)."""
    if not store.mapped:
        raise StoreError(f"{store.path} is read by range: copy a local store.")
    out = Path(output)
    if out.exists():
        raise StoreError(f"output {str(out)!r} already exists; choose another path.")
    root = Path(store.path)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    tokens = store.token_array
    if shard_tokens is None:
        with open(tmp / TOKENS, "wb") as f:
            for start in range(0, store.num_tokens, COPY_TOKENS):
                f.write(np.ascontiguousarray(tokens[start : start + COPY_TOKENS]).tobytes())
    else:
        counts = shard_counts(store.num_tokens, shard_tokens)
        write_shards(tokens, tmp, counts)
        write_shard_list(tmp, store.fingerprint, counts)
    for name in (DOC_OFFSETS, CHECKSUMS, CONTENT, BLOCKS, BLOCKS_INFO, MANIFEST):  # manifest last
        if (root / name).is_file():
            shutil.copyfile(root / name, tmp / name)
    os.rename(tmp, out)
    return TokenStore.open(out)
