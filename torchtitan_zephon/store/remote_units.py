"""How a ``RemoteTokenStore`` reads its units of content check: rounding reads out to
whole blocks (``window_fetch_ratio``: what that costs), the node cache, and the checks
of what arrives (``_RemoteUnits``, a part of ``remote.RemoteTokenStore``); and the
bookkeeping of one fetch (``_Fetch``, ``_Step``) and what opening reads of the block
checksums (``_open_blocks``, ``_read_checksums``).

Node cache (``options.cache_bytes`` > 0, ``store.cache``): the units of content check
(blocks with their block checksum, or chunks) are looked up on local disk first, on the
cache's own thread; only the runs of units it lacks are fetched, and each fetched unit,
once checked, is written to the cache. A cached unit is checked again every time it is
read: a block against the check value stored with it (its block checksum keyed by its
place, ``_place``: the store's seed, the cache kind and its index), a chunk against
checksums.bin at its index; so one that fails, a file under another unit's name
included, is removed and fetched. Stores without content checks (or opened unverified)
use no cache.

Invariant: a unit is served only after its check passed (a block against its block
checksum, a chunk against checksums.bin); a bad cached file is removed and fetched.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any

import numpy as np
import xxhash

from torchtitan_zephon.store.format import (
    BLOCKS,
    BLOCKS_INFO,
    CHECKSUMS,
    REPREPARE,
    TOKENS,
    StoreError,
    block_seed,
    block_span,
    check_file_size,
    num_chunks,
)
from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.object_faults import MissingObject
from torchtitan_zephon.store.opening import (
    check_blocks_info,
    check_checksums,
)
from torchtitan_zephon.store.urls import ObjectURL


class _Fetch:
    """The windows of a set of samples, being fetched: requests (token ranges) and,
    for each sample (sorted unique ids), its request and its offset in it."""

    def __init__(
        self,
        ids: np.ndarray,
        seq_len: int,
        request: np.ndarray,
        offset: np.ndarray,
        nbytes: int,
        future: Future,
    ) -> None:
        self.ids, self.seq_len = ids, seq_len
        self.request, self.offset = request, offset
        self.nbytes = nbytes
        self.future = future

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into ``self.ids`` of each of ``ids``, whether it is there)."""
        pos = np.searchsorted(self.ids, ids)
        hit = pos < self.ids.size
        hit[hit] = self.ids[pos[hit]] == ids[hit]
        return pos, hit

    def fill(self, out: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> None:
        """Write the windows of samples ``self.ids[pos]`` into ``out[rows]`` (waits for
        their bytes, a wait ``location.ObjectFiles`` bounds when the endpoint stops
        answering; raises what the fetch or its content check raised)."""
        arrays = self.future.result()
        width = self.seq_len + 1
        for row, r, o in zip(
            rows.tolist(), self.request[pos].tolist(), self.offset[pos].tolist(), strict=True
        ):
            out[row] = arrays[r][o : o + width]


class _Step:
    """One step's windows read ahead, and how many of its rows were served."""

    def __init__(self, fetch: _Fetch, rows: int) -> None:
        self.fetch, self.rows, self.served = fetch, rows, 0


def _open_blocks(files: ObjectFiles, url: ObjectURL, manifest: dict[str, Any]) -> dict | None:
    """The checked blocks.json of the store (None: it has none) and blocks.bin's size
    checked (one HEAD): the block checksums themselves are read by range, with the tokens."""
    try:
        text = bytes(files.read(BLOCKS_INFO)).decode(errors="replace")
    except MissingObject:
        return None
    redo = (
        f"Run `zephon inspect STORE --upgrade` on the local copy and upload its {BLOCKS} "
        f"and {BLOCKS_INFO} again ({BLOCKS_INFO} last)."
    )
    info = check_blocks_info(text, url.child(BLOCKS_INFO), manifest, redo)
    try:
        size = files.open_file(BLOCKS)
    except MissingObject:
        raise StoreError(
            f"store file {url.child(BLOCKS)!r} is missing ({BLOCKS_INFO} names it). Upload "
            f"it again, {BLOCKS_INFO} after it."
        ) from None
    check_file_size(url.child(BLOCKS), size, np.dtype("<u8"), int(info["num_blocks"]))
    return info


def _read_checksums(
    files: ObjectFiles, url: ObjectURL, num_tokens: int, chunk_tokens: int, recorded: str, where
) -> np.ndarray:
    """checksums.bin, read whole and checked against the hash the content section records."""
    shown = url.child(CHECKSUMS)
    try:
        size = files.open_file(CHECKSUMS)
    except MissingObject:
        raise StoreError(f"store file {shown!r} is missing. {REPREPARE}") from None
    check_file_size(shown, size, np.dtype("<u8"), num_chunks(num_tokens, chunk_tokens))
    checksums = np.frombuffer(files.read(CHECKSUMS), dtype="<u8")
    check_checksums(checksums, recorded, shown, str(where).rsplit("/", 1)[-1])
    return checksums


class _RemoteUnits:
    """The units part of ``remote.RemoteTokenStore`` (module docstring): block rounding,
    the node cache and the checks of fetched units."""

    def _block_cover(
        self, start: np.ndarray, stop: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(first block, last block, first token, stop token) that a read of tokens
        ``[start, stop)`` rounds out to: whole blocks of the store's block_tokens."""
        size = int(self.blocks["block_tokens"])
        first = start // size
        last = np.minimum(
            np.maximum(first, -(-(stop - 1) // size) - 1), int(self.blocks["num_blocks"]) - 1
        )
        return first, last, first * size, np.minimum((last + 1) * size + 1, self.num_tokens)

    def window_fetch_ratio(self, seq_len: int) -> float:
        """Tokens fetched per token of a ``seq_len + 1``-token sample window read alone
        (the mean over window positions; 1.0 without block checksums or when
        block_tokens divides seq_len: then a window is exactly its own blocks)."""
        if not self.blocks or seq_len % int(self.blocks["block_tokens"]) == 0:
            return 1.0
        size = int(self.blocks["block_tokens"])
        period = size // math.gcd(seq_len, size)  # window starts repeat mod size after it
        n = min(period, max(1, (self.num_tokens - 1) // seq_len))
        start = np.arange(n, dtype=np.int64) * seq_len
        _, _, a, b = self._block_cover(start, start + seq_len + 1)
        return float((b - a).mean()) / (seq_len + 1)

    # ------------------------------------------------------------------ fetching

    def _fetch_ranges(
        self, start: np.ndarray, stop: np.ndarray, urgent: bool = False
    ) -> tuple[np.ndarray, np.ndarray, int, Future]:
        """Start fetching token ranges ``[start[k], stop[k])`` (sorted by start): one
        request per run of overlapping or adjacent ranges, each rounded out to the unit
        of the content check (whole blocks, with their block checksums; else whole
        chunks), through the node cache when there is one. (each range's request, its
        offset in that request's tokens, the bytes requested, a Future of each request's
        tokens, checked.) ``urgent``: waited for now (``ObjectFiles.submit_many``)."""
        blocks = self.blocks if self.verifies else None
        unit = self.chunk_tokens if self.verifies and blocks is None else None
        if blocks:
            first, last, a, b = self._block_cover(start, stop)
        elif unit:
            a = start // unit * unit
            b = np.minimum(((stop - 1) // unit + 1) * unit, self.num_tokens)
        else:
            a, b = start, stop
        # A range joins the run before it unless it starts after the furthest end so far
        # (for windows of one length, the previous range's end).
        end = np.maximum.accumulate(b)
        new = np.ones(start.size, dtype=bool)
        new[1:] = a[1:] > end[:-1]
        heads = np.flatnonzero(new)
        tails = np.append(heads[1:] - 1, start.size - 1)
        req_a, req_b = a[heads], end[tails]
        request = np.cumsum(new) - 1
        offset = start - req_a[request]
        item = self.dtype.itemsize
        nbytes = int((req_b - req_a).sum()) * item
        req_a_list = req_a.tolist()
        reads = [(TOKENS, [x * item for x in req_a_list], [x * item for x in req_b.tolist()])]
        if blocks:
            block_first = first[heads].tolist()
            block_last = np.maximum.accumulate(last)[tails].tolist()
            reads.append((BLOCKS, [8 * x for x in block_first], [8 * (x + 1) for x in block_last]))
        if self.cache is not None:
            if blocks:
                runs = list(zip(block_first, block_last, strict=True))
            else:
                runs = list(
                    zip((req_a // unit).tolist(), ((req_b - 1) // unit).tolist(), strict=True)
                )
            return request, offset, nbytes, self._cached(runs, urgent)

        def arrived(datas: list[list[memoryview]]) -> list[np.ndarray]:
            arrays = [np.frombuffer(d, dtype=self.dtype) for d in datas[0]]
            if blocks:
                for arr, sums, block in zip(arrays, datas[1], block_first, strict=True):
                    self._check_blocks(arr, np.frombuffer(sums, dtype="<u8"), block)
            elif unit:
                for arr, x in zip(arrays, req_a_list, strict=True):
                    self._check_range(arr, x, unit)
            return arrays

        return request, offset, nbytes, self._files.submit_many(reads, then=arrived, urgent=urgent)

    def read_spans(self, start: np.ndarray, stop: np.ndarray) -> list[np.ndarray]:
        """Tokens ``[start[k], stop[k])`` for each k, fetched now (``_fetch_ranges``),
        checked: how packed samples (``job.packed``) read a store in object storage."""
        start = np.asarray(start, dtype=np.int64).ravel()
        stop = np.asarray(stop, dtype=np.int64).ravel()
        if not start.size:
            return []
        if int(start.min()) < 0 or int(stop.max()) > self.num_tokens or (stop < start).any():
            raise IndexError(f"token spans must lie in [0, {self.num_tokens}).")
        order = np.argsort(start, kind="stable")
        request, offset, _, future = self._fetch_ranges(start[order], stop[order], urgent=True)
        arrays = future.result()
        out: list[np.ndarray] = [np.empty(0, self.dtype)] * start.size
        lengths = (stop - start)[order].tolist()
        for k, r, o, n in zip(
            order.tolist(), request.tolist(), offset.tolist(), lengths, strict=True
        ):
            out[k] = arrays[r][o : o + n]
        return out

    # ------------------------------------------------------------------ the node cache

    def _unit(self) -> tuple[int, int]:
        """(tokens per unit of content check, tokens a unit overlaps the next by)."""
        if self.blocks:
            return int(self.blocks["block_tokens"]), 1
        return self.chunk_tokens, 0

    def _span(self, unit: int) -> tuple[int, int]:
        size, overlap = self._unit()
        return unit * size, min(unit * size + size + overlap, self.num_tokens)

    def _from_cache(self, unit: int) -> np.ndarray | None:
        """Unit ``unit``'s tokens from the node cache, checked (None: not cached, or its
        file was bad: then removed)."""
        data = self.cache.get(unit)
        if data is None:
            return None
        start, stop = self._span(unit)
        want = (stop - start) * self.dtype.itemsize
        if self.blocks:
            good = len(data) == want + 8
            if good:
                tokens = np.frombuffer(data, dtype=self.dtype, count=stop - start)
                stored = int(np.frombuffer(data, dtype="<u8", offset=want)[0])
                digest = xxhash.xxh3_64_intdigest(tokens, block_seed(self.fingerprint))
                good = digest ^ self._place(unit) == stored
        else:
            good = len(data) == want
            if good:
                tokens = np.frombuffer(data, dtype=self.dtype)
                good = xxhash.xxh3_64_intdigest(tokens) == int(self._sums[unit])
        if not good:  # truncated, garbage or another unit's: never served, fetched again
            self.cache.discard(unit)
            return None
        self.cache.hit(len(data))
        return tokens

    def _place(self, unit: int) -> int:
        """What a cached block's check value is keyed by: its place (the store's seed,
        the cache kind and the unit index). The file holds the block checksum XOR this,
        so a file under another unit's name (or kind, or store) fails its check."""
        place = f"{self.cache.kind}/{unit}".encode()
        return xxhash.xxh3_64_intdigest(place, block_seed(self.fingerprint))

    def _cached(self, runs: list[tuple[int, int]], urgent: bool = False) -> Future:
        """A Future of the tokens of each run of units (``first``, ``last`` inclusive):
        the units the node cache holds (checked) read from disk, the rest fetched (one
        request per run of missing units, checked on arrival) and then cached. The disk
        work runs on the cache's thread, the fetches on the fetch thread."""
        out: Future = Future()
        size, overlap = self._unit()
        item = self.dtype.itemsize
        pieces: dict[int, np.ndarray] = {}
        missing: list[list[int]] = []  # runs of units not cached: [first, last]

        def assemble() -> list[np.ndarray]:
            arrays = []
            for first, last in runs:
                parts = [pieces[u][:size] for u in range(first, last)] + [pieces[last]]
                arrays.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
            return arrays

        def finish(fetched: Future) -> None:
            try:
                units: list[tuple[int, np.ndarray, bytes]] = fetched.result()
                for unit, tokens, _ in units:
                    pieces[unit] = tokens
                self.cache.put_many((unit, data) for unit, _, data in units)
                out.set_result(assemble())
            except BaseException as e:  # noqa: BLE001 - handed to the reader
                out.set_exception(e)

        def lookup() -> None:
            try:
                for first, last in runs:
                    for u in range(first, last + 1):
                        tokens = self._from_cache(u)
                        if tokens is not None:
                            pieces[u] = tokens
                        elif missing and missing[-1][1] == u - 1:
                            missing[-1][1] = u
                        else:
                            missing.append([u, u])
                if not missing:
                    out.set_result(assemble())
                    return
                spans = [(self._span(f)[0], self._span(lo)[1]) for f, lo in missing]
                reads = [(TOKENS, [a * item for a, _ in spans], [b * item for _, b in spans])]
                if self.blocks:
                    reads.append(
                        (BLOCKS, [8 * f for f, _ in missing], [8 * (lo + 1) for _, lo in missing])
                    )
                fetched = self._files.submit_many(reads, then=split, urgent=urgent)
                fetched.add_done_callback(lambda f: self._submit(finish, f, out))
            except BaseException as e:  # noqa: BLE001 - handed to the reader
                out.set_exception(e)

        def split(datas: list[list[memoryview]]) -> list[tuple[int, np.ndarray, bytes]]:
            """Check each fetched run (fetch thread) and cut it into its units."""
            units = []
            for k, ((first, last), data) in enumerate(zip(missing, datas[0], strict=True)):
                arr = np.frombuffer(data, dtype=self.dtype)
                if self.blocks:
                    sums = np.frombuffer(datas[1][k], dtype="<u8")
                    self._check_blocks(arr, sums, first)
                else:
                    self._check_range(arr, first * size, size)
                    sums = None
                for u in range(first, last + 1):
                    lo = (u - first) * size
                    tokens = arr[lo : lo + size + overlap]
                    raw = tokens.tobytes()
                    if sums is not None:  # the block checksum, keyed by the unit's place
                        raw += np.array([int(sums[u - first]) ^ self._place(u)], "<u8").tobytes()
                    units.append((u, tokens, raw))
            return units

        self._submit(lookup, None, out)
        return out

    def _submit(self, fn: Any, arg: Any, out: Future) -> None:
        """Run ``fn`` (with ``arg``) on the cache's thread; a store closed meanwhile fails
        ``out``."""
        try:
            if arg is None:
                self._pool.submit(fn)
            else:
                self._pool.submit(fn, arg)
        except RuntimeError as e:
            if not out.done():
                out.set_exception(StoreError(f"token store {str(self.path)!r} was closed ({e})."))

    def _check_blocks(self, arr: np.ndarray, sums: np.ndarray, block: int) -> None:
        """Hash every block of ``arr`` (tokens from block ``block`` on, whole blocks)
        against ``sums``, their block checksums as read."""
        size = int(self.blocks["block_tokens"])
        seed = block_seed(self.fingerprint)
        digest = xxhash.xxh3_64_intdigest
        for k, expected in enumerate(sums.tolist()):
            lo = k * size
            if digest(arr[lo : lo + size + 1], seed) != expected:
                raise self.block_mismatch(block + k)

    def block_mismatch(self, block: int) -> StoreError:
        """The error for block ``block`` of tokens.bin not matching its block checksum."""
        start, stop = block_span(block, self.num_tokens, int(self.blocks["block_tokens"]))
        return StoreError(
            f"token store {str(self.path)!r}: block {block} of {TOKENS} (tokens [{start}, "
            f"{stop})) does not match its checksum in {BLOCKS}; an object was changed or "
            f"corrupted after preparation. Run `zephon inspect {self.path} --check` to list "
            "every bad chunk and block, and upload the store again from an intact copy."
        )

    def _check_range(self, arr: np.ndarray, first: int, unit: int) -> None:
        """Hash every chunk of ``arr`` (tokens from ``first``, whole chunks)."""
        sums = self._sums
        for chunk in range(first // unit, -(-(first + arr.size) // unit)):
            lo = chunk * unit - first
            if xxhash.xxh3_64_intdigest(arr[lo : lo + unit]) != int(sums[chunk]):
                raise self.chunk_mismatch(chunk)
