"""A file of a store in object storage read as an array, by page: only what is indexed.

Role: a store of 10^10 documents keeps 80 GB of document offsets and a packing index of
the same order; a node reading a few samples a step must not fetch them whole.
``PagedArray`` reads a raw or ``.npy`` array of a store's file (``location.ObjectFiles``:
ranges, ``If-Match`` the ETag recorded when the file was first read) in pages of
``PAGE_BYTES``, fetching the pages an index touches that it does not hold (missing
pages of one lookup in one batch of requests), and keeps the ``pages_kept`` most
recently used; or, ``exact``, the bytes of the rows an index touches and nothing
more (one request per run of neighbouring rows, all of one lookup in one batch; nothing
kept): a packing index kept with its store is read so, a sample's rows at a time.
Indexing follows numpy's for what the packed source asks: an integer,
an integer array or a slice on the first axis, and ``[rows, column]``.

Invariant: ``a[key]`` equals ``np.load(file)[key]`` for the file as it was when the
array was opened (a replaced object fails the read, naming it); memory stays within
``pages_kept`` pages whatever is read; ``__array__`` (the whole file) is the one read in
proportion to the file, asked for explicitly.
"""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from torchtitan_zephon.store.format import StoreError

PAGE_BYTES = 1 << 12
"""A page: 4 KiB. Lookups land at random (a packed sample's index rows and its
documents' offsets, in a shuffled order), so a page beyond a few rows is fetched for
nothing: ``zephon bench corpus`` measured 46-98 bytes fetched per byte of packed samples
delivered with 64 KiB pages (seq_len 512). Neighbouring pages of one lookup still come in
one request."""
PAGES_KEPT = 512
"""Pages kept per array (2 MiB at 4 KiB pages)."""


class PagedArray:
    """An array in the file ``name`` of ``files`` (see the module docstring)."""

    def __init__(
        self,
        files: Any,
        name: str,
        dtype: Any,
        shape: tuple[int, ...],
        offset: int = 0,
        pages_kept: int = PAGES_KEPT,
        exact: bool = False,
    ) -> None:
        self.files, self.name = files, name
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(n) for n in shape)
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape)) if self.shape else 1
        self.offset = int(offset)
        self.row_bytes = self.dtype.itemsize * (
            int(np.prod(self.shape[1:])) if self.ndim > 1 else 1
        )
        self.pages_kept = max(1, int(pages_kept))
        self.exact = bool(exact)
        self._pages: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def of_npy(cls, files: Any, name: str, shown: str, exact: bool = False) -> PagedArray:
        """The ``.npy`` file ``name`` (``shown`` in messages): its size and ETag recorded
        (one HEAD), its header read, its data paged (``exact``: read by row)."""
        size = files.open_file(name)
        head = bytes(files.submit(name, [0], [min(4096, size)], urgent=True).result()[0])
        try:
            f = io.BytesIO(head)
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read(f)
        except (ValueError, EOFError) as e:
            raise StoreError(f"{shown} is not an .npy array ({e}).") from None
        if fortran:
            raise StoreError(f"{shown} is a Fortran-ordered array; expected C order.")
        return cls(files, name, dtype, shape, offset=f.tell(), exact=exact)

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"PagedArray({self.name!r}, {self.shape}, {self.dtype})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole array: one read of the whole file (asked for explicitly)."""
        whole = self._rows(np.arange(self.shape[0], dtype=np.int64))
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, tuple):
            rows, *rest = key
            return self[rows][(slice(None), *rest) if not np.isscalar(rows) else tuple(rest)]
        if isinstance(key, slice):
            return self._rows(np.arange(*key.indices(self.shape[0]), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.shape[0] if key < 0 else 0)
            return self._rows(np.array([i], dtype=np.int64))[0]
        index = np.asarray(key, dtype=np.int64)
        return self._rows(index.ravel()).reshape(index.shape + self.shape[1:])

    def _rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (ints on the first axis), read through the pages."""
        n = self.shape[0]
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise IndexError(f"index outside [0, {n}) of {self.name}")
        out = np.empty((rows.size, *self.shape[1:]), dtype=self.dtype)
        if not rows.size:
            return out
        if self.exact:
            return self._exact_rows(rows, out)
        start = self.offset + rows * self.row_bytes
        first, last = start // PAGE_BYTES, (start + self.row_bytes - 1) // PAGE_BYTES
        wanted: set[int] = set()
        for a, b in zip(first.tolist(), last.tolist(), strict=True):
            wanted.update(range(a, b + 1))
        pages = self._pages_of(sorted(wanted))
        flat = out.reshape(rows.size, -1).view(np.uint8).reshape(rows.size, self.row_bytes)
        for r, (s, a, b) in enumerate(
            zip(start.tolist(), first.tolist(), last.tolist(), strict=True)
        ):
            data = pages[a] if a == b else b"".join(pages[p] for p in range(a, b + 1))
            lo = s - a * PAGE_BYTES
            flat[r] = np.frombuffer(data, dtype=np.uint8, count=self.row_bytes, offset=lo)
        return out

    def _exact_rows(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows ``rows`` read by range: one request per run of neighbouring rows."""
        unique, where = np.unique(rows, return_inverse=True)
        new = np.ones(unique.size, dtype=bool)
        new[1:] = unique[1:] != unique[:-1] + 1
        heads = np.flatnonzero(new)
        tails = np.append(heads[1:], unique.size)
        first, stop = unique[heads], unique[tails - 1] + 1
        starts = (self.offset + first * self.row_bytes).tolist()
        stops = (self.offset + stop * self.row_bytes).tolist()
        datas = self.files.submit(self.name, starts, stops, urgent=True).result()
        got = np.concatenate([np.frombuffer(d, dtype=self.dtype) for d in datas])
        out[...] = got.reshape(unique.size, *self.shape[1:])[where.ravel()]
        return out

    def _pages_of(self, wanted: list[int]) -> dict[int, bytes]:
        """Pages ``wanted``, from those kept or fetched now (one batch of requests)."""
        with self._lock:
            held = {p: self._pages[p] for p in wanted if p in self._pages}
            for p in held:
                self._pages.move_to_end(p)
        missing = [p for p in wanted if p not in held]
        if missing:
            end = self.offset + self.shape[0] * self.row_bytes
            runs: list[list[int]] = []
            for p in missing:  # neighbouring pages: one request
                if runs and runs[-1][1] == p:
                    runs[-1][1] = p + 1
                else:
                    runs.append([p, p + 1])
            starts = [a * PAGE_BYTES for a, _ in runs]
            stops = [min(b * PAGE_BYTES, end) for _, b in runs]
            datas = self.files.submit(self.name, starts, stops, urgent=True).result()
            for (a, b), data in zip(runs, datas, strict=True):
                data = bytes(data)
                for p in range(a, b):
                    held[p] = data[(p - a) * PAGE_BYTES : (p - a + 1) * PAGE_BYTES]
            with self._lock:
                for p in missing:
                    self._pages[p] = held[p]
                    self._pages.move_to_end(p)
                while len(self._pages) > self.pages_kept:
                    self._pages.popitem(last=False)
        return held
