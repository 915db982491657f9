"""A store's packing index on disk: built once per (store, seq_len), checked, mapped.

Role: ``open_packing(store, seq_len)`` gives the ``order.packing.PackedSamples`` of a
store at ``seq_len``: read from the cache when it is there, else built once
(``ingest.cache_folder.build_once``: under a lock, into a staging folder renamed into
place) from the store's document offsets, its chunks packed by ``workers`` processes.
Where: ``<cache>/packing/<store fingerprint>/best_fit-L<seq_len>-v<format>/`` (the
cache: ``$ZEPHON_CACHE``, else ``zephon.cache_dir``, else
``~/.cache/torchtitan_zephon``), so a read-only or shared store needs no write access
and every node keeps its own copy (the same bytes: the index is deterministic). It
holds ``starts.npy`` and ``pieces.npy`` (memory-mapped on open) and ``manifest.json``:
the store's fingerprint, ``seq_len``, the packing field (method and constants), the
counts, and the xxh3-128 of both arrays.

Invariants:
- An index is used only for the store, ``seq_len`` and packing constants it was built
  for, and only when its arrays hash to what its manifest says: anything else (another
  store's entry, a hand edit, a torn copy) is a damaged cache entry, which
  ``open_packing`` moves aside and builds again, saying so once (``read_index`` alone
  refuses it, naming the folder).
- Building it reads only the document offsets (O(documents)), checked against the
  store's manifest first; the tokens are not read. A store in object storage
  (``store.remote``) is packed the same way: each node's first process to open it
  fetches ``doc_offsets.bin`` whole (8 bytes a document) and builds the index in that
  node's cache; the others wait for it (``build_once``) and map it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.ingest.cache_folder import build_once, cache_root
from torchtitan_zephon.order.packing import PackedSamples, pack, packing_field
from torchtitan_zephon.store.format import (
    DOC_OFFSETS,
    MANIFEST,
    REPREPARE,
    StoreError,
    file_xxh3_128,
)
from torchtitan_zephon.store.reader import TokenStore

STARTS, PIECES = "starts.npy", "pieces.npy"


def document_lengths(store: TokenStore) -> np.ndarray:
    """Tokens of each document of ``store`` (each with its EOS)."""
    offsets = np.asarray(store.doc_offsets, dtype=np.int64)
    return np.diff(np.append(offsets, np.int64(store.num_tokens)))


def index_folder(store: TokenStore, seq_len: int, cache_dir: str = "") -> Path:
    field = packing_field("best_fit")
    assert field is not None
    name = f"best_fit-L{int(seq_len)}-v{field['format']}"
    return cache_root(cache_dir) / "packing" / store.fingerprint / name


def _manifest(store: TokenStore, packed: PackedSamples, folder: Path) -> dict[str, Any]:
    return {
        "kind": "packing index",
        "store_fingerprint": store.fingerprint,
        "seq_len": packed.seq_len,
        "packing": packing_field("best_fit"),
        "num_documents": store.num_documents,
        "num_samples": packed.num_samples,
        "num_pieces": packed.num_pieces,
        "tokens": packed.tokens(),
        "padding_fraction": packed.padding_fraction(),
        "split_documents": packed.split_documents(),
        "starts_xxh3_128": file_xxh3_128(folder / STARTS),
        "pieces_xxh3_128": file_xxh3_128(folder / PIECES),
    }


def build_index(store: TokenStore, seq_len: int, dest: Path, workers: int = 1) -> None:
    """Pack ``store``'s documents at ``seq_len`` into the index folder ``dest`` (its
    document offsets checked against the manifest first)."""
    content = store.content
    if content is not None and store.doc_offsets_xxh3_128() != content["doc_offsets_xxh3_128"]:
        raise StoreError(
            f"{DOC_OFFSETS} of the store {store.path} does not match its recorded checksum "
            f"(document boundaries changed after preparation): it cannot be packed. {REPREPARE}"
        )
    lengths = document_lengths(store)
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            packed = pack(lengths, seq_len, map_fn=pool.map)
    else:
        packed = pack(lengths, seq_len)
    dest.mkdir(parents=True)
    np.save(dest / STARTS, packed.starts)
    np.save(dest / PIECES, packed.pieces)
    manifest = _manifest(store, packed, dest)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


class DamagedIndex(StoreError):
    """A packing index on disk that is not the one asked for, or is damaged; ``why``
    says what, without the folder."""

    def __init__(self, folder: Path, why: str) -> None:
        super().__init__(
            f"the packing index {folder} {why}; it is a cache: remove it, and the next use "
            "builds it again"
        )
        self.why = why


def read_index(store: TokenStore, seq_len: int, folder: Path) -> PackedSamples:
    """The index in ``folder``, checked against ``store`` and ``seq_len``; DamagedIndex
    (a StoreError naming the folder once) when it is not theirs or its arrays do not
    hash as recorded."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        want = {
            "store_fingerprint": store.fingerprint,
            "seq_len": int(seq_len),
            "packing": packing_field("best_fit"),
        }
        wrong = sorted(k for k, v in want.items() if manifest.get(k) != v)
        if wrong:
            raise DamagedIndex(
                folder,
                f"is not the one of store {store.fingerprint[:16]}... at seq_len {seq_len} (it "
                f"differs in {', '.join(wrong)})",
            )
        for name, key in ((STARTS, "starts_xxh3_128"), (PIECES, "pieces_xxh3_128")):
            if file_xxh3_128(folder / name) != manifest.get(key):
                raise DamagedIndex(
                    folder, f"is damaged: {name} does not hash to what its manifest records "
                    "(edited or torn)",
                )  # fmt: skip
        starts = np.load(folder / STARTS, mmap_mode="r")
        pieces = np.load(folder / PIECES, mmap_mode="r")
    except DamagedIndex:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise DamagedIndex(folder, f"cannot be read ({e})") from None
    packed = PackedSamples(seq_len=int(seq_len), starts=starts, pieces=pieces)
    if packed.num_samples != manifest.get("num_samples") or pieces.shape[1:] != (3,):
        raise DamagedIndex(folder, "does not hold what its manifest says")
    return packed


def open_packing(
    store: TokenStore,
    seq_len: int,
    *,
    cache_dir: str = "",
    workers: int = 1,
    log: Callable[[str], None] | None = None,
) -> tuple[PackedSamples, Path]:
    """``store``'s packing index at ``seq_len`` and its folder, built on first use."""
    if store.doc_offsets is None:
        raise StoreError(
            f"the store {store.path} has no document offsets to pack: write it again with "
            "zephon prepare."
        )
    folder = index_folder(store, seq_len, cache_dir)

    def built() -> PackedSamples:
        build_once(
            folder,
            lambda dest, _progress: build_index(store, seq_len, dest, workers),
            what=f"the packing index of {store.path} at seq_len {seq_len}",
            log=log,
        )
        return read_index(store, seq_len, folder)

    try:
        return built(), folder
    except DamagedIndex as e:  # a cache: moved aside (one process wins) and built again
        say = log or (lambda text: warnings.warn(text, stacklevel=3))
        say(f"the packing index {folder} {e.why}: it is a cache, so it is built again")
        aside = folder.with_name(f".{folder.name}.damaged-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(folder, aside)
        except FileNotFoundError:
            pass  # another process moved it first
        shutil.rmtree(aside, ignore_errors=True)
        return built(), folder


def packing_note(packed: PackedSamples, store: TokenStore, folder: Path) -> str:
    """One line on what packing makes of ``store``: samples, split documents, padding."""
    return (
        f"packing best_fit: {packed.num_samples} packed samples of seq_len {packed.seq_len} "
        f"from {store.num_documents} documents ({packed.split_documents()} longer than "
        f"seq_len, cut into pieces), padding {packed.padding_fraction():.2%}; the ids are "
        f"packed sample ids (index: {folder})"
    )
