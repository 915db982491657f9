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

Kept with the store (issue 45): ``build_beside`` writes the index into the store's own
folder, ``<store>/packing/best_fit-L<seq_len>-v<format>/`` (the same files), once, as
part of ``zephon prepare --pack-seq-len L`` (or a registration): the documents' chunks
are shared by the prepare's ranks (each packs its chunks into a staging folder beside
it; rank 0 joins them in chunk order, so any number of ranks writes the bytes of one
process). With it, ``spans.npy``: per piece, where its tokens start in the store and
the xxh3-64 of the tokens a read of it takes (``piece_spans``), hashed from the tokens
once, each store chunk checked first; a store in a bucket reads a packed sample's
tokens exactly by them, no block rounding and no document-offset lookup (``zephon bench
corpus``). ``open_packing`` maps a local store's own index first: opening then builds,
reads and hashes nothing in proportion to the corpus (its manifest and the arrays'
sizes are checked; ``zephon inspect STORE --check`` hashes them); a store without one
is packed into the cache as before.

Invariants:
- An index is used only for the store, ``seq_len`` and packing constants it was built
  for, and only when its arrays hash to what its manifest says: anything else (another
  store's entry, a hand edit, a torn copy) is a damaged cache entry, which
  ``open_packing`` moves aside and builds again, saying so once (``read_index`` alone
  refuses it, naming the folder).
- Building it reads only the document offsets (O(documents)), checked against the
  store's manifest first; the tokens are not read (but by ``build_beside``, for the
  spans).
- A kept index's ``spans.npy`` row k is piece k's first token in the store (x2, +1
  when it reads one more), its length, and the xxh3-64 of exactly the tokens it reads;
  a read by span serves those tokens only if they hash to it (tested against the local
  store: tests/remote/test_packed_remote.py). A store in object storage
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
import xxhash

from torchtitan_zephon.ingest.cache_folder import build_once, cache_root
from torchtitan_zephon.ingest.ranks import OneProcess, together
from torchtitan_zephon.order.packing import (
    PackedSamples,
    chunks,
    pack,
    pack_chunk,
    packing_field,
)
from torchtitan_zephon.store.format import (
    DOC_OFFSETS,
    MANIFEST,
    REPREPARE,
    StoreError,
    block_seed,
    file_xxh3_128,
)
from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.object_faults import MissingObject
from torchtitan_zephon.store.reader import TokenStore

STARTS, PIECES, SPANS = "starts.npy", "pieces.npy", "spans.npy"
STORE_PACKING = "packing"
"""The folder of a store's own packing indexes, beside its files (``build_beside``)."""


def document_lengths(store: TokenStore) -> np.ndarray:
    """Tokens of each document of ``store`` (each with its EOS)."""
    offsets = np.asarray(store.doc_offsets, dtype=np.int64)
    return np.diff(np.append(offsets, np.int64(store.num_tokens)))


SPAN_BATCH = 1 << 12
"""Pieces whose tokens a store in a bucket fetches at once to hash them."""


def piece_spans(
    store: TokenStore, rows: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
) -> np.ndarray:
    """The spans of pieces ``rows`` (document, start, length), int64 [n, 3]: column 0
    is the piece's first token in the store times 2, plus 1 when it reads one token more
    (it does not end its document: the label of its last token); column 1 its length;
    column 2 the xxh3-64 (seeded by the store's fingerprint, as block checksums are) of
    the tokens it reads, as int64: a read needs nothing else of the index. ``offsets`` and ``lengths``: every document's. The store's chunks under
    those tokens are checked first (a local store), or fetched checked (one in a bucket)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
    doc, start, length = rows[:, 0], rows[:, 1], rows[:, 2]
    begin = offsets[doc] + start
    extra = (start + length < lengths[doc]).astype(np.int64)
    take = length + extra
    seed = block_seed(store.fingerprint)
    digest = xxhash.xxh3_64_intdigest
    sums: list[int] = []
    if store.mapped:
        if rows.shape[0] and store.verifies:
            c = int(store.chunk_tokens)
            lo, hi = int(begin.min()), int((begin + take).max()) - 1
            for chunk in range(lo // c, hi // c + 1):
                store.check_chunk(chunk)
        tokens = store.token_array
        sums = [
            digest(tokens[b : b + t], seed)
            for b, t in zip(begin.tolist(), take.tolist(), strict=True)
        ]
    else:
        for a in range(0, rows.shape[0], SPAN_BATCH):
            b, t = begin[a : a + SPAN_BATCH], take[a : a + SPAN_BATCH]
            sums.extend(digest(x, seed) for x in store.read_spans(b, b + t))
    out = np.empty((rows.shape[0], 3), dtype=np.int64)
    out[:, 0] = begin * 2 + extra
    out[:, 1] = length
    out[:, 2] = np.array(sums, dtype=np.uint64).view(np.int64)
    return out


def index_name(seq_len: int) -> str:
    field = packing_field("best_fit")
    assert field is not None
    return f"best_fit-L{int(seq_len)}-v{field['format']}"


def index_folder(store: TokenStore, seq_len: int, cache_dir: str = "") -> Path:
    return cache_root(cache_dir) / "packing" / store.fingerprint / index_name(seq_len)


def beside_folder(store: TokenStore, seq_len: int) -> Path | None:
    """The store's own index folder at ``seq_len`` (``build_beside``); None for a store
    read by range."""
    if not store.mapped:
        return None
    return Path(store.path) / STORE_PACKING / index_name(seq_len)


def _manifest(store: TokenStore, packed: PackedSamples, folder: Path) -> dict[str, Any]:
    names = (STARTS, PIECES, SPANS) if (folder / SPANS).exists() else (STARTS, PIECES)
    return index_manifest(
        store.fingerprint,
        store.num_documents,
        packed,
        tuple(file_xxh3_128(folder / name) for name in names),
    )


def index_manifest(
    store_fingerprint: str, num_documents: int, packed: Any, hashes: tuple[str, ...]
) -> dict[str, Any]:
    """The manifest of the packing index ``packed`` (a ``PackedSamples``, or anything
    with its counts: ``seq_len``, ``num_samples``, ``num_pieces``, ``tokens()``,
    ``padding_fraction()``, ``split_documents()``) of a store of ``num_documents``
    documents, whose starts.npy and pieces.npy (and spans.npy, a third hash) hash
    (xxh3-128) to ``hashes``."""
    spans = {"spans_xxh3_128": hashes[2]} if len(hashes) > 2 else {}
    return spans | {
        "kind": "packing index",
        "store_fingerprint": store_fingerprint,
        "seq_len": int(packed.seq_len),
        "packing": packing_field("best_fit"),
        "num_documents": int(num_documents),
        "num_samples": int(packed.num_samples),
        "num_pieces": int(packed.num_pieces),
        "tokens": int(packed.tokens()),
        "padding_fraction": packed.padding_fraction(),
        "split_documents": int(packed.split_documents()),
        "starts_xxh3_128": hashes[0],
        "pieces_xxh3_128": hashes[1],
    }


def build_beside(
    store: TokenStore, seq_len: int, ranks: Any = None, cache_dir: str = ""
) -> Path | str:
    """Build ``store``'s packing index at ``seq_len`` into its own folder
    (``beside_folder``), its chunks shared by ``ranks`` (an ``ingest.ranks.Ranks``;
    default: this process alone), and return the folder (see the module docstring).
    A store in object storage gets it under its prefix (``<prefix>/packing/...``,
    uploaded by rank 0, manifest last), staged in the cache (``cache_dir``, which the
    ranks must share), and the URL is returned."""
    ranks = ranks or OneProcess()
    folder = beside_folder(store, seq_len)
    if folder is None:  # in a bucket: staged in the cache, uploaded
        staging = cache_root(cache_dir) / "packing-build" / store.fingerprint / index_name(seq_len)
    else:
        staging = folder.parent / f".{folder.name}.build"
    offsets = np.asarray(store.doc_offsets, dtype=np.int64)
    lengths = np.diff(np.append(offsets, np.int64(store.num_tokens)))
    spans = chunks(int(lengths.size))

    def start() -> None:
        if ranks.rank == 0:
            _check_offsets(store)
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)

    def pack_mine() -> None:
        for k in range(ranks.rank, len(spans), ranks.world_size):
            a, b = spans[k]
            sizes, rows = pack_chunk(lengths[a:b], a, seq_len)
            np.save(staging / f"{k}.sizes.npy", sizes)
            np.save(staging / f"{k}.rows.npy", rows)
            np.save(staging / f"{k}.spans.npy", piece_spans(store, rows, offsets, lengths))

    def join() -> None:
        if ranks.rank != 0:
            return
        parts = [(np.load(staging / f"{k}.sizes.npy"), np.load(staging / f"{k}.rows.npy"))
                 for k in range(len(spans))]  # fmt: skip
        sizes = np.concatenate([s for s, _ in parts]) if parts else np.zeros(0, np.int64)
        rows = np.concatenate([r for _, r in parts]) if parts else np.zeros((0, 3), np.int64)
        starts = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        kept = [np.load(staging / f"{k}.spans.npy") for k in range(len(spans))]
        dest = staging / "index"
        packed = PackedSamples(int(seq_len), starts, rows)
        _write_index(
            store, packed, dest, np.concatenate(kept) if kept else np.zeros((0, 3), np.int64)
        )
        if folder is None:
            _upload(store, seq_len, dest)
        else:
            if folder.exists():
                shutil.rmtree(folder)
            os.rename(dest, folder)
        shutil.rmtree(staging, ignore_errors=True)

    for step in (start, pack_mine, join):
        together(ranks, step)
    return folder if folder is not None else f"{store.path}/{STORE_PACKING}/{index_name(seq_len)}"


def _upload(store: Any, seq_len: int, dest: Path) -> None:
    """The index files in ``dest`` uploaded under the store's prefix, manifest last."""
    files = ObjectFiles(store.url)
    try:
        for name in (STARTS, PIECES, SPANS, MANIFEST):
            files.upload(f"{STORE_PACKING}/{index_name(seq_len)}/{name}", dest / name)
    finally:
        files.close()


def read_beside(store: TokenStore, seq_len: int, folder: Path) -> PackedSamples:
    """The store's own index in ``folder``, mapped: its manifest checked against
    ``store`` and ``seq_len`` and its arrays against the manifest's counts, without
    reading them (DamagedIndex otherwise; ``zephon inspect --check`` hashes them)."""
    return read_index(store, seq_len, folder, hash_arrays=False)


def check_beside(store: TokenStore) -> list[str]:
    """What is wrong with the store's own packing indexes (``zephon inspect STORE
    --check``): each read whole and hashed against its manifest."""
    root = Path(store.path) / STORE_PACKING
    problems = []
    for folder in sorted(root.glob("best_fit-L*-v*")) if store.mapped and root.is_dir() else []:
        try:
            seq_len = int(folder.name.split("-L", 1)[1].split("-", 1)[0])
            read_index(store, seq_len, folder)
        except (DamagedIndex, ValueError) as e:
            problems.append(str(e))
    return problems


def read_kept_remote(store: Any, seq_len: int) -> tuple[PackedSamples, str] | None:
    """The packing index a store in object storage keeps at ``seq_len``
    (``<prefix>/packing/best_fit-L<seq_len>-v<format>/``, uploaded with it) and its URL:
    its manifest read and checked, its arrays read by page as they are looked up
    (``store.paged``); None when the store keeps none."""
    name = f"{STORE_PACKING}/{index_name(seq_len)}"
    shown = f"{store.path}/{name}"
    try:
        manifest = json.loads(store.read_file(f"{name}/{MANIFEST}"))
    except MissingObject:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedIndex(shown, f"cannot be read ({e})") from None
    _check_manifest(store, seq_len, manifest, shown)
    starts = store.paged_npy(f"{name}/{STARTS}", exact=True)
    pieces = store.paged_npy(f"{name}/{PIECES}", exact=True)
    spans = store.paged_npy(f"{name}/{SPANS}", exact=True) if _has_spans(manifest) else None
    packed = PackedSamples(int(seq_len), starts, pieces, _recorded(manifest), spans)  # type: ignore[arg-type]
    _check_counts(packed, manifest, shown)
    return packed, shown


def _has_spans(manifest: dict[str, Any]) -> bool:
    """Whether the index keeps its pieces' spans (``piece_spans``; an index of an
    earlier version does not, and is read through the document offsets)."""
    return "spans_xxh3_128" in manifest


def _check_manifest(store: TokenStore, seq_len: int, manifest: Any, folder: Any) -> None:
    want = {
        "store_fingerprint": store.fingerprint,
        "seq_len": int(seq_len),
        "packing": packing_field("best_fit"),
    }
    got = manifest if isinstance(manifest, dict) else {}
    wrong = sorted(k for k, v in want.items() if got.get(k) != v)
    if wrong:
        raise DamagedIndex(
            folder,
            f"is not the one of store {store.fingerprint[:16]}... at seq_len {seq_len} (it "
            f"differs in {', '.join(wrong)})",
        )


def _recorded(manifest: dict[str, Any]) -> tuple[int, int] | None:
    recorded = (manifest.get("tokens"), manifest.get("split_documents"))
    return recorded if all(type(v) is int for v in recorded) else None  # type: ignore[return-value]


def _check_counts(packed: PackedSamples, manifest: dict[str, Any], folder: Any) -> None:
    spans = packed.spans
    if (
        packed.num_samples != manifest.get("num_samples")
        or packed.num_pieces != manifest.get("num_pieces")
        or tuple(packed.pieces.shape[1:]) != (3,)
        or (spans is not None and tuple(spans.shape) != (packed.num_pieces, 3))
    ):
        raise DamagedIndex(folder, "does not hold what its manifest says")


def _check_offsets(store: TokenStore) -> None:
    content = store.content
    if content is not None and store.doc_offsets_xxh3_128() != content["doc_offsets_xxh3_128"]:
        raise StoreError(
            f"{DOC_OFFSETS} of the store {store.path} does not match its recorded checksum "
            f"(document boundaries changed after preparation): it cannot be packed. {REPREPARE}"
        )


def _write_index(
    store: TokenStore, packed: PackedSamples, dest: Path, spans: np.ndarray | None = None
) -> None:
    dest.mkdir(parents=True)
    np.save(dest / STARTS, packed.starts)
    np.save(dest / PIECES, packed.pieces)
    if spans is not None:
        np.save(dest / SPANS, spans)
    manifest = _manifest(store, packed, dest)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def build_index(store: TokenStore, seq_len: int, dest: Path, workers: int = 1) -> None:
    """Pack ``store``'s documents at ``seq_len`` into the index folder ``dest`` (its
    document offsets checked against the manifest first)."""
    _check_offsets(store)
    lengths = document_lengths(store)
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            packed = pack(lengths, seq_len, map_fn=pool.map)
    else:
        packed = pack(lengths, seq_len)
    _write_index(store, packed, dest)


class DamagedIndex(StoreError):
    """A packing index on disk that is not the one asked for, or is damaged; ``why``
    says what, without the folder."""

    def __init__(self, folder: Path | str, why: str) -> None:
        super().__init__(
            f"the packing index {folder} {why}; it is a cache: remove it, and the next use "
            "builds it again"
        )
        self.why = why


def read_index(
    store: TokenStore, seq_len: int, folder: Path, *, hash_arrays: bool = True
) -> PackedSamples:
    """The index in ``folder``, checked against ``store`` and ``seq_len``; DamagedIndex
    (a StoreError naming the folder once) when it is not theirs or its arrays do not
    hash as recorded (``hash_arrays``: read whole to check; else only their shapes)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        _check_manifest(store, seq_len, manifest, folder)
        arrays = [(STARTS, "starts_xxh3_128"), (PIECES, "pieces_xxh3_128")]
        if _has_spans(manifest):
            arrays.append((SPANS, "spans_xxh3_128"))
        for name, key in arrays:
            if hash_arrays and file_xxh3_128(folder / name) != manifest.get(key):
                raise DamagedIndex(
                    folder, f"is damaged: {name} does not hash to what its manifest records "
                    "(edited or torn)",
                )  # fmt: skip
        starts = np.load(folder / STARTS, mmap_mode="r")
        pieces = np.load(folder / PIECES, mmap_mode="r")
        spans = np.load(folder / SPANS, mmap_mode="r") if _has_spans(manifest) else None
    except DamagedIndex:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise DamagedIndex(folder, f"cannot be read ({e})") from None
    packed = PackedSamples(int(seq_len), starts, pieces, _recorded(manifest), spans)
    _check_counts(packed, manifest, folder)
    return packed


def open_packing(
    store: TokenStore,
    seq_len: int,
    *,
    cache_dir: str = "",
    workers: int = 1,
    log: Callable[[str], None] | None = None,
) -> tuple[PackedSamples, Path]:
    """``store``'s packing index at ``seq_len`` and its folder: the store's own
    (``build_beside``: mapped, nothing built or hashed), else the cache's, built on
    first use."""
    if store.mapped and store.doc_offsets is None:  # (one in a bucket reads them by page)
        raise StoreError(
            f"the store {store.path} has no document offsets to pack: write it again with "
            "zephon prepare."
        )
    beside = beside_folder(store, seq_len)
    if beside is not None and (beside / MANIFEST).is_file():  # the store's own: mapped
        return read_beside(store, seq_len, beside), beside
    if not store.mapped:
        kept = read_kept_remote(store, seq_len)
        if kept is not None:  # the store's own, in the bucket: read by page
            return kept
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
