"""Several stores read as one: a mixture's samples gathered by one fancy index.

Role: ``StoreGroup`` serves rows of (store, sample id) pairs across stores of one
dtype, each checked like the store's own read.

Stores read by range (object storage) have no map, and sharded stores (``shards``)
one per shard: a group holding one gathers its rows store by store, through each
store's own ``windows``.

Invariant: row k of ``windows(sources, ids, seq_len)`` equals
``stores[sources[k]].windows([ids[k]], seq_len)[0]``, and the group reads only rows
wholly inside one store's map (every pair is bounds-checked before the gather). It
uses only ``TokenStore``'s public interface (``tokens``, ``checked_flags``,
``check_chunk``), so a change inside the reader cannot break the group unseen.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from torchtitan_zephon.store.format import (
    StoreError,
)
from torchtitan_zephon.store.reader import TokenStore


class StoreGroup:
    """Several stores of one dtype read together: a mixture's samples, most rows of a
    window from a different store, gathered by one fancy index whatever the number of
    stores.

    Row k of ``windows(sources, ids, seq_len)`` is the window of sample ``ids[k]`` of
    ``stores[sources[k]]``, equal to ``stores[sources[k]].windows([ids[k]], seq_len)[0]``
    and checked like it: every chunk a row touches is hashed before any row is served.

    Mechanics: the stores' token maps stay at fixed addresses. One read-only view
    (``as_strided``) starts at the lowest map and reaches the end of the highest, with a
    window of ``seq_len + 1`` tokens at every token offset; sample ``j`` of store ``i``
    is the window at the store's offset (in tokens) plus ``j x seq_len``. The view
    spans the gaps between the maps too, so memory safety rests on one invariant: the
    group reads only rows wholly inside one store's map. Every (source, id) pair is
    checked against ``[0, stores) x [0, num_samples)`` before the gather, and the group
    holds every store (so every map) for its lifetime. The content checks keep one flag
    per (store, chunk) in one array, a cache of the stores' own flags (which only go from
    unchecked to checked), so "is every chunk these rows touch checked" is a few
    vectorized operations across all stores, and nothing once every chunk is checked.
    """

    def __init__(self, stores: list[TokenStore]) -> None:
        if not stores:
            raise StoreError("a store group needs at least one store, found none.")
        if len({st.dtype for st in stores}) > 1:
            raise StoreError(
                "a store group needs stores of one token dtype, found "
                f"{sorted({str(st.dtype) for st in stores})}."
            )
        self.stores = list(stores)
        self.dtype = self.stores[0].dtype
        # Stores read by range (``remote.RemoteTokenStore``) have no map, sharded ones
        # (``shards``) several: their rows are gathered store by store, through each
        # store's own ``windows``.
        self.mapped = all(st.mapped and not st.shards for st in self.stores)
        self._rows: dict[int, np.ndarray] = {}
        self._limits: dict[int, np.ndarray] = {}
        self._num_stores = np.uint64(len(self.stores))
        if not self.mapped:
            self._unchecked = 0
            return
        arrays = [st.tokens.view(np.ndarray) for st in self.stores]
        addresses = [int(a.__array_interface__["data"][0]) for a in arrays]
        low, item = min(addresses), self.dtype.itemsize
        if any((a - low) % item for a in addresses):  # maps are page-aligned: never
            raise StoreError(f"a store group needs token maps aligned to {item} bytes.")
        self._base = arrays[addresses.index(low)]
        self._offsets = np.array([(a - low) // item for a in addresses], dtype=np.int64)
        end = max(a + x.nbytes for a, x in zip(addresses, arrays, strict=True))
        self._span = (end - low) // item  # tokens from the lowest map to the end of the highest
        # One flag per chunk of a checked store; a store that is not checked (no checksums,
        # or verify=False) has one flag, always set, and a chunk longer than any store.
        flags = [st.checked_flags() if st.verifies else np.ones(1, dtype=np.bool_) for st in stores]
        self._flag_starts = np.cumsum([0] + [f.size for f in flags]).tolist()
        self._flag_base = np.array(self._flag_starts[:-1], dtype=np.int64)
        self._chunk_tokens = np.array(
            [st.chunk_tokens if st.verifies else 1 << 62 for st in stores], dtype=np.int64
        )
        self._flags = np.concatenate(flags)  # a copy: set here only after the store checked
        self._unchecked = int(self._flags.size - np.count_nonzero(self._flags))
        self._lock = threading.Lock()

    def windows(self, sources: Any, ids: Any, seq_len: int) -> np.ndarray:
        """``sources`` and ``ids``: integer arrays (or lists) of equal length."""
        src = np.asarray(sources, dtype=np.int64).ravel()
        idv = np.asarray(ids, dtype=np.int64).ravel()
        if src.shape != idv.shape:
            raise ValueError(f"{src.size} sources for {idv.size} sample ids; give one each.")
        limits = self._limits.get(seq_len)
        if limits is None:
            counts = [st.num_samples(seq_len) for st in self.stores]
            limits = self._limits[seq_len] = np.array(counts, dtype=np.uint64)
        if not src.size:
            return np.empty((0, seq_len + 1), dtype=self.dtype)
        # Bounds first (the class invariant). As unsigned, a negative value is huge, so one
        # comparison each tests 0 <= source < stores and 0 <= id < num_samples;
        # count_nonzero is the cheapest reduction on a window's few rows.
        if np.count_nonzero(src.view(np.uint64) >= self._num_stores):
            lo, hi = int(src.min()), int(src.max())
            raise IndexError(
                f"sample keys name sources in [{lo}, {hi}], the mixture has "
                f"{len(self.stores)} sources."
            )
        if np.count_nonzero(idv.view(np.uint64) >= limits[src]):
            k = int(np.argmax(idv.view(np.uint64) >= limits[src]))
            i = int(src[k])
            raise IndexError(
                f"sample id {int(idv[k])} outside [0, {int(limits[i])}) for seq_len {seq_len} "
                f"in {str(self.stores[i].path)!r}."
            )
        if not self.mapped:
            out = np.empty((src.size, seq_len + 1), dtype=self.dtype)
            for i in np.unique(src).tolist():
                rows = np.flatnonzero(src == i)
                out[rows] = self.stores[i].windows(idv[rows], seq_len)
            return out
        if self._unchecked:  # 0 once every chunk of every store was checked (or checks off)
            self._check(src, idv * seq_len, seq_len)
        rows = self._rows.get(seq_len)
        if rows is None:
            item = self.dtype.itemsize
            rows = self._rows[seq_len] = as_strided(
                self._base,
                shape=(max(self._span - seq_len, 0), seq_len + 1),
                strides=(item, item),
                writeable=False,
            )
        # Every row lies inside one store's map: checked above (the class invariant).
        return rows[self._offsets[src] + idv * seq_len]

    def _check(self, src: np.ndarray, starts: np.ndarray, seq_len: int) -> None:
        """Hash every unchecked chunk these windows touch, before any is served."""
        chunk = self._chunk_tokens[src]
        first = starts // chunk
        last = (starts + seq_len) // chunk  # the chunk of the label token
        base = self._flag_base[src]
        reach = int((last - first).max())
        if reach <= 1:
            need = np.concatenate([base + first, base + last])
        else:  # windows longer than a chunk
            grid = first[:, None] + np.arange(reach + 1)
            need = (base[:, None] + grid)[grid <= last[:, None]]
        missing = need[~self._flags[need]]
        if not missing.size:
            return
        starts_of = self._flag_starts
        for flag in np.unique(missing).tolist():
            i = bisect.bisect_right(starts_of, flag) - 1
            st, c = self.stores[i], flag - starts_of[i]
            st.check_chunk(c)  # StoreError naming the store and the chunk if it differs
            with self._lock:
                if not self._flags[flag]:
                    self._flags[flag] = True
                    self._unchecked -= 1
