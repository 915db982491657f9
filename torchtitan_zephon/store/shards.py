"""A store's tokens in many files (shards): the layout, reading it as one array, writing it.

Role: a store of a Llama-3-size corpus (15 T tokens, ~60 TB in uint32) cannot be one
``tokens.bin``: an object store caps an object at 5 TiB (Google Cloud Storage; S3's
limit was 5 TiB until recently, and is still that on many S3-compatible stores), ext4 a
file at 16 TiB. A sharded store keeps its tokens, in order, in shard files
``tokens/000000.bin``, ``tokens/000001.bin``, ... (each a contiguous run of the store's
tokens, little-endian, in the manifest's dtype) and says so in ``shards.json``::

    {"format": "zephon-token-shards", "version": 1, "fingerprint": <the manifest's>,
     "tokens": [n0, n1, ...]}        # tokens per shard, in order, each >= 1

instead of ``tokens.bin``. Everything else of the store (manifest, doc_offsets.bin,
checksums.bin, blocks) is the same file as in the one-file store of the same tokens.

A store over token files read in place (``ingest.token_files``: Megatron-LM's ``.bin``,
OLMo's numpy files) lists them instead: ``"files": [path, ...]``, one per shard (an
absolute path, or relative to the store folder), read where they are, never copied.

Invariants:
- Sharding is a storage detail: shards.json is not part of the manifest, so the same
  tokens as one file or as shards of any sizes have the same manifest, hence the same
  fingerprint, samples, order, data-config fingerprint and sequence-log digests; a run
  moves freely between them (``writer.write_store_as`` makes one from the other).
- ``ShardedTokens`` reads like the one-file map: ``tokens[a:b]``, ``tokens[index]``
  and ``rows(starts, width)`` return exactly what the same slices, gathers and rows of
  the concatenated shards would, a read across a shard boundary included, and never
  copy the store whole (``__array__`` is the one exception, asked for explicitly).
- A store opens only when shards.json names its manifest's fingerprint (a stale or
  foreign one is refused), its counts are positive integers summing to the manifest's
  ``num_tokens``, and every shard file exists at exactly the size its count implies
  (local: at open; in object storage: the first read of a short or missing shard
  fails naming it). Which tokens a shard holds is checked as a one-file store's are:
  chunk (or block) checksums over the global token index, so shards swapped, edited or
  from another store fail on the first read of a bad chunk.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan_zephon.store.format import REPREPARE, SHARD_FOLDER, SHARDS, StoreError, map_file

SHARDS_FORMAT = "zephon-token-shards"
SHARD_BYTES = 1 << 30
"""The default shard size (``zephon prepare --shard-bytes``): 1 GiB, far below every
object store's cap, large enough that a 60 TB store is ~60,000 objects."""


def shard_name(k: int) -> str:
    """The file (object) name of shard ``k``, relative to the store."""
    return f"{SHARD_FOLDER}/{k:06d}.bin"


def shard_counts(num_tokens: int, shard_tokens: int) -> list[int]:
    """Tokens per shard of a store of ``num_tokens`` cut into shards of ``shard_tokens``
    (the last may be shorter)."""
    if shard_tokens < 1:
        raise ValueError(f"a shard holds at least one token, got {shard_tokens}.")
    full, rest = divmod(int(num_tokens), int(shard_tokens))
    return [int(shard_tokens)] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class ShardList:
    """What shards.json says: the tokens of each shard and, for token files read in
    place, each shard's file (None: ``shard_name`` in the store folder)."""

    counts: list[int]
    files: list[str] | None = None

    def path(self, root: Path, k: int) -> Path:
        """The file of shard ``k`` of the store folder ``root``."""
        return root / (self.files[k] if self.files is not None else shard_name(k))


def shard_section(
    fingerprint: str, counts: Sequence[int], files: Sequence[str] | None = None
) -> dict[str, Any]:
    """The content of shards.json for a store of fingerprint ``fingerprint`` whose shards
    hold ``counts`` tokens (in ``files``, read in place, when given)."""
    section: dict[str, Any] = {
        "format": SHARDS_FORMAT,
        "version": 1,
        "fingerprint": fingerprint,
        "tokens": [int(c) for c in counts],
    }
    if files is not None:
        section["files"] = [str(f) for f in files]
    return section


def check_shards(text: str | bytes, where: str, manifest: dict[str, Any]) -> ShardList:
    """The shards that shards.json (``text``, read from ``where``) records for the store
    of ``manifest``, checked (see the module docstring); StoreError otherwise."""
    try:
        info = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise StoreError(f"cannot read {where!r}: {e}. {REPREPARE}") from None
    if not isinstance(info, dict) or info.get("format") != SHARDS_FORMAT:
        raise StoreError(f"{where!r} is not a shard list (expected format {SHARDS_FORMAT!r}).")
    if info.get("version") != 1:
        raise StoreError(
            f"{where!r} has shard list version {info.get('version')!r}; this version of "
            f"zephon reads version 1. {REPREPARE}"
        )
    if info.get("fingerprint") != manifest["fingerprint"]:
        found = str(info.get("fingerprint"))[:16]
        raise StoreError(
            f"{where!r} belongs to another store (fingerprint {found}...), not to the "
            f"manifest beside it ({manifest['fingerprint'][:16]}...): the store's shards "
            f"were mixed with another store's. {REPREPARE}"
        )
    counts = info.get("tokens")
    if (
        not isinstance(counts, list)
        or not counts
        or any(type(c) is not int or c < 1 for c in counts)
    ):
        raise StoreError(
            f"{where!r} must list the tokens of each shard as integers >= 1 (field "
            f"'tokens'). {REPREPARE}"
        )
    total = sum(counts)
    if total != int(manifest["num_tokens"]):
        raise StoreError(
            f"{where!r} lists {total} tokens in {len(counts)} shards; the manifest holds "
            f"{int(manifest['num_tokens'])}. {REPREPARE}"
        )
    files = info.get("files")
    if files is not None and (
        not isinstance(files, list)
        or len(files) != len(counts)
        or not all(isinstance(f, str) and f for f in files)
    ):
        raise StoreError(
            f"{where!r} must name one file per shard (field 'files': {len(counts)} paths). "
            f"{REPREPARE}"
        )
    return ShardList(counts, files)


def read_shards(root: Path, manifest: dict[str, Any]) -> ShardList | None:
    """The checked tokens per shard of the store folder ``root`` (None: a one-file store,
    no shards.json)."""
    path = root / SHARDS
    if not path.is_file():
        return None
    try:
        text = path.read_bytes()
    except OSError as e:
        raise StoreError(f"cannot read {str(path)!r}: {e}. {REPREPARE}") from None
    return check_shards(text, str(path), manifest)


def open_shards(root: Path, shards: ShardList, dtype: np.dtype) -> ShardedTokens:
    """The shards of the store folder ``root`` memory-mapped read-only, each checked to
    exist at the size its count implies (``format.map_file``: a StoreError naming it)."""
    return ShardedTokens(
        [map_file(shards.path(root, k), dtype, c) for k, c in enumerate(shards.counts)]
    )


class ShardedTokens:
    """A store's tokens held by several arrays (its shards' maps), read as one array."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        if not arrays:
            raise ValueError("a sharded store has at least one shard")
        self.arrays = [a.view(np.ndarray) for a in arrays]  # plain views: cheaper slices
        self.dtype = self.arrays[0].dtype
        self.itemsize = self.dtype.itemsize
        self.bounds = np.cumsum([0] + [p.size for p in self.arrays], dtype=np.int64)
        self._starts = self.bounds[:-1].tolist()
        self.size = int(self.bounds[-1])
        self.shape = (self.size,)
        self.ndim = 1
        self.nbytes = self.size * self.itemsize

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"ShardedTokens({len(self.arrays)} shards, {self.size} tokens, {self.dtype})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Every token in one array: a copy of the whole store (asked for explicitly)."""
        whole = np.concatenate(self.arrays)
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                return self.take(np.arange(start, stop, step, dtype=np.int64))
            return self.slice(start, stop)
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.size if key < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"token {int(key)} outside a store of {self.size} tokens")
            k = bisect.bisect_right(self._starts, i) - 1
            return self.arrays[k][i - self._starts[k]]
        return self.take(np.asarray(key))

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop): a view inside one shard, a copy across shards."""
        start, stop = max(int(start), 0), min(int(stop), self.size)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        k = bisect.bisect_right(self._starts, start) - 1
        base = self._starts[k]
        if stop <= base + self.arrays[k].size:
            return self.arrays[k][start - base : stop - base]
        spans = []
        while start < stop:
            base = self._starts[k]
            end = min(stop, base + self.arrays[k].size)
            spans.append(self.arrays[k][start - base : end - base])
            start, k = end, k + 1
        return np.concatenate(spans)

    def take(self, index: np.ndarray) -> np.ndarray:
        """Tokens at the positions ``index`` (any shape), as ``ndarray[index]`` gives them."""
        index = np.asarray(index, dtype=np.int64)
        flat = index.ravel()
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.size):
            raise IndexError(f"token index outside a store of {self.size} tokens")
        shard = np.searchsorted(self.bounds, flat, side="right") - 1
        out = np.empty(flat.size, dtype=self.dtype)
        for k in np.unique(shard).tolist():
            where = shard == k
            out[where] = self.arrays[k][flat[where] - self._starts[k]]
        return out.reshape(index.shape)

    def rows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Rows ``[len(starts), width]``: row r is tokens [starts[r], starts[r] + width),
        each within the store. The rows inside one shard are one gather from a sliding
        view of it (no copy of the shard); a row across shards is put together."""
        starts = np.asarray(starts, dtype=np.int64).ravel()
        width = int(width)
        out = np.empty((starts.size, width), dtype=self.dtype)
        if not starts.size:
            return out
        shard = np.searchsorted(self.bounds, starts, side="right") - 1
        ends = self.bounds[np.minimum(shard + 1, len(self.arrays))]
        inside = starts + width <= ends
        if starts.size <= 256:  # a micro-batch: one slice per row beats grouping by shard
            local = (starts - self.bounds[shard]).tolist()
            for r, (k, lo, ok) in enumerate(
                zip(shard.tolist(), local, inside.tolist(), strict=True)
            ):
                if ok:
                    out[r] = self.arrays[k][lo : lo + width]
                else:
                    out[r] = self.slice(int(starts[r]), int(starts[r]) + width)
            return out
        order = np.argsort(shard, kind="stable")
        cuts = np.flatnonzero(np.diff(shard[order])) + 1
        for rows in np.split(order, cuts):
            k = int(shard[rows[0]])
            ok = rows[inside[rows]]
            out[ok] = self._sliding(k, width)[starts[ok] - self._starts[k]]
            for r in rows[~inside[rows]].tolist():
                out[r] = self.slice(int(starts[r]), int(starts[r]) + width)
        return out

    def _sliding(self, k: int, width: int) -> np.ndarray:
        """Read-only [size - width + 1, width] view of shard ``k``: row i is its tokens
        i .. i + width (no copy)."""
        shard = self.arrays[k]
        item = shard.itemsize
        n = max(shard.size - width + 1, 0)
        return np.lib.stride_tricks.as_strided(
            shard, shape=(n, width), strides=(item, item), writeable=False
        )


def write_shards(tokens: Any, root: Path, counts: Sequence[int]) -> None:
    """Write ``tokens`` (an array or ``ShardedTokens``) as the shard files of the store
    folder ``root``, shard k holding ``counts[k]`` tokens; each written aside, then
    renamed (a shard present is whole)."""
    folder = root / SHARD_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    start = 0
    for k, count in enumerate(counts):
        path = root / shard_name(k)
        part = np.ascontiguousarray(tokens[start : start + count])
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(part.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        start += count


def write_shard_list(
    root: Path, fingerprint: str, counts: Sequence[int], files: Sequence[str] | None = None
) -> None:
    """Write shards.json of the store folder ``root`` (aside, then renamed)."""
    path = root / SHARDS
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(shard_section(fingerprint, counts, files), indent=1) + "\n")
    os.replace(tmp, path)


def byte_ranges(bounds: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Byte range [start, stop) of the concatenated shards (shard k holding bytes
    [bounds[k], bounds[k + 1])) as (shard, start, stop) ranges within each shard, in
    order: how a read by range of a sharded store in object storage is cut."""
    out = []
    k = bisect.bisect_right(bounds, start) - 1
    while start < stop:
        end = min(stop, bounds[k + 1])
        out.append((k, start - bounds[k], end - bounds[k]))
        start, k = end, k + 1
    return out
