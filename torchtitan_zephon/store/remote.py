"""A token store in object storage, read by byte range, ahead of the plan.

Role: ``RemoteTokenStore`` is a ``reader.TokenStore`` whose files are objects under a
prefix (``location.ObjectFiles``) instead of memory maps. Opening it makes the same
checks as a local store, with the same code (``opening.check_manifest``,
``check_content``, ``check_checksums``, ``format.check_file_size``), so a store copied
to a bucket has the fingerprint of its local original and a run moves freely between
the two. Its reads serve the same windows as the local store's.

Read-ahead: the order is a pure function of the step, so the loader knows which
samples a rank reads at every future step; it hands them here step by step
(``read_ahead``), and each step's windows are fetched in the background: rounded out to
the blocks (chunks) of the content check, neighbouring and overlapping ranges coalesced into one
request, at most ``max_requests`` requests in flight (``location.ObjectFiles``). A store
with block checksums (blocks.json, ``format``: written by prepare, ``--block-tokens``)
rounds to whole blocks of the store's block_tokens (a window is exactly its own blocks
when block_tokens divides seq_len; ``window_fetch_ratio`` says what rounding costs
otherwise) and reads each run's block checksums from blocks.bin by range with its
tokens (8 bytes per block, counted as fetched); one without rounds to
whole 65,536-token chunks and reads checksums.bin whole at open. Every block (chunk) is
hashed on arrival, on the fetch thread, before its future resolves. A
``windows`` call takes its rows from the steps read ahead and waits for those not yet
arrived (the loader's data wait); ids never read ahead are fetched on the spot, the same
way. A step's buffer is freed once its windows were served (or, partly served, once a
later step is read: what a reset leaves); at most
``read_ahead_bytes`` are held (a step larger than that is still fetched, alone).

Node cache (``options.cache_bytes`` > 0, ``store.cache``): the blocks of content check
(with their block checksum; in a store without block checksums, chunks) are looked up on local disk first, on the
cache's own thread; only the runs of blocks it lacks are fetched, and each fetched block,
once checked, is written to the cache. A cached block is checked again every time it is
read: a block against the check value stored with it (its block checksum keyed by its
place, ``_place``: the store's seed, the cache kind and its index), a chunk against
checksums.bin at its index; so one that fails, a file under another block's name
included, is removed and fetched. Stores without content checks (or opened unverified)
use no cache.

Invariants:
- Row k of ``windows(ids, seq_len)`` equals the local store's ``windows`` row for the
  same store content, and every token served was fetched with ``If-Match`` the ETag
  recorded at open (or read from the node cache of this fingerprint) and checked
  against its block's (or chunk's) checksum, or a span's own checksum kept with a
  packing index (``_fetch_summed``), before it is served; a mismatch of fetched
  bytes is a StoreError naming the store and the block (chunk), raised by the read that
  needs it (a bad cached file is a miss, not an error).
- Opening reads the manifest and blocks.json (with block checksums; HEADs give the
  other files' sizes) or the manifest and checksums.bin (without), and nothing of
  tokens.bin, blocks.bin or doc_offsets.bin (fetched on first use, by range or, for
  ``check``, whole).
- A block (chunk) is served only after its check passed (a block against its block
  checksum, a chunk against checksums.bin); a bad cached file is removed and fetched.
- ``fetched_bytes`` counts every byte read from object storage (manifest and checksums
  of either kind included), never a node-cache hit; ``served_bytes`` the bytes of the
  windows served.
"""

from __future__ import annotations

import json
import math
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from torchtitan_zephon.store.cache import NodeCache
from torchtitan_zephon.store.format import (
    BLOCKS,
    BLOCKS_INFO,
    CHECKSUMS,
    CONTENT,
    DOC_OFFSETS,
    DTYPES,
    MANIFEST,
    REPREPARE,
    SHARDS,
    STORE_FILES,
    TOKENS,
    ContentReport,
    StoreError,
    UncheckedStoreWarning,
    block_seed,
    block_span,
    check_file_size,
    num_chunks,
)
from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.object_faults import MissingBucket, MissingObject
from torchtitan_zephon.store.opening import (
    check_blocks_info,
    check_checksums,
    check_content,
    check_manifest,
)
from torchtitan_zephon.store.paged import PagedArray
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote_options import (
    RemoteOptions,
)
from torchtitan_zephon.store.shards import check_shards, shard_name
from torchtitan_zephon.store.urls import ObjectURL, is_url, parse_url


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


def _join_shards(
    files: ObjectFiles, url: ObjectURL, manifest: dict[str, Any], dtype: np.dtype
) -> int:
    """The shards of a sharded store in object storage (``shards``), checked as a local
    store's shards.json is and joined as its tokens.bin (``ObjectFiles.join``); their
    number, or 0 when there is no shards.json (then tokens.bin is missing)."""
    try:
        text = bytes(files.read(SHARDS))
    except MissingObject:
        return 0
    shards = check_shards(text, url.child(SHARDS), manifest)
    counts = shards.counts
    if shards.files is None:
        names = [shard_name(k) for k in range(len(counts))]
    else:  # token files read in place: objects of the store's bucket (``ingest.token_files``)
        names = [_in_bucket(f, url, SHARDS) for f in shards.files]
    files.join(TOKENS, [(n, c * dtype.itemsize) for n, c in zip(names, counts, strict=True)])
    return len(counts)


def _in_bucket(value: str, url: ObjectURL, where: str) -> str:
    """The object a store in a bucket names in ``where`` (a URL in the store's bucket)
    as a name from the bucket's root (``/key``: ``location.ObjectFiles``)."""
    found = parse_url(value, f"a token file of {url.child(where)}") if is_url(value) else None
    if not isinstance(found, ObjectURL) or (found.scheme, found.bucket) != (url.scheme, url.bucket):
        raise StoreError(
            f"{url.child(where)} names the token file {value!r}, which is not an object of "
            f"{url.scheme}://{url.bucket}: a store in a bucket reads token files in place "
            "in its own bucket. Register the files again into a store there (zephon "
            "prepare URLs --input-format ... --output URL)."
        )
    return "/" + found.prefix


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


def _runs(
    a: np.ndarray, b: np.ndarray, gap: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ranges ``[a[k], b[k])`` (sorted by ``a``) joined into requests: a range joins the
    run before it unless it starts more than ``gap`` tokens after the furthest end so
    far. (first range of each run, last range of each run, each run's start and end,
    each range's run.)"""
    end = np.maximum.accumulate(b)
    new = np.ones(a.size, dtype=bool)
    new[1:] = a[1:] > end[:-1] + gap
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:] - 1, a.size - 1)
    return heads, tails, a[heads], end[tails], np.cumsum(new) - 1


SPAN_GAP_BYTES = 1 << 10
"""Ranges with their own checksums (a packed sample's pieces) this close are fetched in
one request, the bytes between them too: ``zephon bench corpus`` measured 2.5 requests a
sample instead of 3.0 for 0.9 % more bytes at seq_len 4096 (1.7 requests for 31 % more
at 16 KiB)."""


class RemoteTokenStore(TokenStore, reads_object_urls=True):
    """A token store under an object-storage prefix; open it with ``open_url`` (or
    ``TokenStore.open(URL)``). See the module docstring."""

    _files: ObjectFiles
    options: RemoteOptions
    blocks: dict[str, Any] | None
    """blocks.json (the store has block checksums: reads check blocks), or None."""

    @classmethod
    def open_url(
        cls, url: ObjectURL, *, verify: bool = True, options: RemoteOptions | None = None
    ) -> RemoteTokenStore:
        """Open and validate the store under ``url``: the checks of a local store, on the
        objects (manifest, sizes, checksums.bin), reading no tokens."""
        options = options or RemoteOptions()
        files = ObjectFiles(
            url,
            request_timeout_s=options.request_timeout_s,
            max_requests=options.max_requests,
            retries=options.retries,
        )
        try:
            return cls._open_files(files, url, verify, options)
        except BaseException:  # a refused store leaves no thread behind
            files.close()
            raise

    @classmethod
    def _open_files(
        cls, files: ObjectFiles, url: ObjectURL, verify: bool, options: RemoteOptions
    ) -> RemoteTokenStore:
        try:
            files.open_file(MANIFEST)
        except MissingBucket:
            raise
        except MissingObject:
            name = url.prefix.rpartition("/")[2]
            if name in STORE_FILES:  # a store's file named, not its prefix
                prefix = url.shown.split("?")[0].rsplit("/", 1)[0]
                raise StoreError(
                    f"{url.shown} names the store file {name}, not a store: a store in "
                    f"object storage is named by its prefix, {prefix}"
                ) from None
            raise StoreError(
                f"{url.shown} holds no token store: it has no {MANIFEST} "
                f"({files.missing_store_reason()}). Expected the prefix of a store written "
                f"by `zephon prepare --output {url.shown}`, or a local store uploaded with "
                f"{MANIFEST} last (`aws s3 cp --recursive STORE {url.shown} --exclude "
                f"{MANIFEST}`, then `aws s3 cp STORE/{MANIFEST} {url.shown}/`); if an upload "
                "is under way, wait for it; if one was cut, run it again."
            ) from None
        mshown = url.child(MANIFEST)
        try:
            text = bytes(files.read(MANIFEST)).decode()
        except UnicodeDecodeError as e:
            raise StoreError(f"cannot read {mshown!r}: {e}. {REPREPARE}") from None
        manifest = check_manifest(text, mshown, url.shown)
        dtype = DTYPES[manifest["dtype"]]
        num_tokens = int(manifest["num_tokens"])
        shards = 0
        for name, kind, count in (
            (TOKENS, dtype, num_tokens),
            (DOC_OFFSETS, np.dtype("<i8"), int(manifest["num_documents"])),
        ):
            try:
                size = files.open_file(name)
            except MissingObject:
                if name == TOKENS:  # a sharded store: its shards read as tokens.bin
                    shards = _join_shards(files, url, manifest, dtype)
                    if shards:
                        continue
                raise StoreError(
                    f"store file {url.child(name)!r} is missing. Upload the whole store "
                    f"again, {MANIFEST} last."
                ) from None
            check_file_size(url.child(name), size, kind, count)
        content, where = None, mshown
        if manifest["version"] >= 2:
            content = manifest["content"]
        else:
            where = url.child(CONTENT)
            try:
                content = json.loads(bytes(files.read(CONTENT)))
            except MissingObject:
                content = None
            except ValueError as e:
                raise StoreError(f"cannot read {where!r}: {e}.") from None
        checksums, blocks = None, None
        if content is None:
            warnings.warn(
                f"token store {url.shown!r} has no content checksums (store format version "
                "1): changed or corrupt tokens cannot be detected when it is read. Upgrade "
                "the local copy with `zephon inspect STORE --upgrade` and upload it again.",
                UncheckedStoreWarning,
                stacklevel=4,
            )
        else:
            chunk_tokens, recorded = check_content(content, where)
            blocks = _open_blocks(files, url, manifest)
            if blocks is None:  # chunk checks: checksums.bin read whole (8 B / chunk)
                checksums = _read_checksums(files, url, num_tokens, chunk_tokens, recorded, where)
        store = cls(url.shown, manifest, None, None, content, checksums, verify=verify)
        store.shards = shards
        store._files = files
        store.url = url
        store.options = options
        store.blocks = blocks
        if blocks is not None:
            store.num_chunks = num_chunks(num_tokens, store.chunk_tokens)
            store.verifies = bool(verify)
        if options.cache_bytes > 0 and store.verifies:  # unchecked tokens are never cached
            kind = f"blocks-{blocks['block_tokens']}" if blocks else f"chunks-{store.chunk_tokens}"
            block_tokens = int(blocks["block_tokens"]) + 1 if blocks else store.chunk_tokens
            largest = block_tokens * store.dtype.itemsize + 8  # the largest block file, and its sum
            if options.cache_bytes < largest:
                warnings.warn(
                    f"zephon.cache_bytes = {options.cache_bytes} is smaller than one cached "
                    f"block of {url.shown!r} ({largest} bytes: a {kind} block): the node cache "
                    "will hold nothing. Raise --zephon.cache_bytes, or set 0 to turn it off.",
                    stacklevel=4,
                )
            store.cache = NodeCache(options.cache_dir, store.fingerprint, kind, options.cache_bytes)
            store._pool = ThreadPoolExecutor(1, thread_name_prefix="zephon-cache")
        return store

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._doc_offsets: np.ndarray | None = None
        self._paged_offsets: PagedArray | None = None
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._steps: deque[_Step] = deque()  # steps read ahead, oldest first
        self._queued: deque[tuple[np.ndarray, int]] = deque()  # (ids, seq_len) not yet fetched
        self._held = 0  # bytes of the steps in self._steps
        self.served_bytes = 0
        self.cache: NodeCache | None = None
        """The node-local cache (``store.cache``; None: zephon.cache_bytes = 0)."""
        self._pool: ThreadPoolExecutor | None = None  # the cache's disk work

    def __repr__(self) -> str:
        return (
            f"RemoteTokenStore({str(self.path)!r}, tokens={self.num_tokens}, "
            f"documents={self.num_documents}, fingerprint={self.fingerprint[:12]})"
        )

    # ------------------------------------------------------------------ what was read

    @property
    def fetched_bytes(self) -> int:
        """Bytes read from object storage so far (manifest and checksums included)."""
        return self._files.fetched_bytes

    @property
    def requests(self) -> int:
        """Range requests made so far."""
        return self._files.requests

    @property
    def read_ahead_steps(self) -> int:
        return self.options.read_ahead_steps

    # ------------------------------------------------------------------ lazily read files

    @property  # type: ignore[override]
    def doc_offsets(self) -> np.ndarray:
        if self._doc_offsets is None:
            self._doc_offsets = np.frombuffer(self._files.read(DOC_OFFSETS), dtype="<i8")
        return self._doc_offsets

    @doc_offsets.setter
    def doc_offsets(self, value: np.ndarray | None) -> None:
        self._doc_offsets = value

    def paged_offsets(self) -> PagedArray:
        """The document offsets read by page, only those looked up (``paged``): what a
        packed source asks per sample, never the whole file."""
        if self._paged_offsets is None:
            self._paged_offsets = PagedArray(self._files, DOC_OFFSETS, "<i8", (self.num_documents,))
        return self._paged_offsets

    def paged_npy(self, name: str, exact: bool = False) -> PagedArray:
        """The ``.npy`` array in the store's file ``name`` (a packing index kept with the
        store, ``job.packing``), read by page (``exact``: by row, ``store.paged``)."""
        return PagedArray.of_npy(self._files, name, self.url.child(name), exact=exact)

    def read_file(self, name: str) -> bytes:
        """The whole (small) file ``name`` of the store: ``MissingObject`` when there is
        none."""
        return bytes(self._files.read(name))

    def all_tokens(self) -> np.ndarray:
        """Every token, fetched whole (``check``: one pass over the store)."""
        return np.frombuffer(self._files.read(TOKENS), dtype=self.dtype)

    def doc_offsets_xxh3_128(self) -> str:
        return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(self.doc_offsets))

    def block_checksums(self) -> tuple[dict[str, Any] | None, np.ndarray]:
        if self.blocks is None:
            return None, np.zeros(0, dtype="<u8")
        return self.blocks, np.frombuffer(self._files.read(BLOCKS), dtype="<u8")

    def check(self) -> ContentReport:
        """``TokenStore.check`` on the fetched store (checksums.bin fetched whole first when
        the store reads block checksums)."""
        if self.checksums is None and self.content is not None:
            chunk_tokens, recorded = check_content(self.content, self.path)
            self.checksums = _read_checksums(
                self._files, self.url, self.num_tokens, chunk_tokens, recorded, MANIFEST
            )
            self._sums = self.checksums
            self.num_chunks = int(self.checksums.size)
            self._checked = bytearray(self.num_chunks)
            self._checked_np = np.frombuffer(self._checked, dtype=np.bool_)
        return super().check()

    # ------------------------------------------------------------------ fetching

    def _fetch(self, ids: np.ndarray, seq_len: int, urgent: bool = False) -> _Fetch:
        """Start fetching the windows of samples ``ids`` (``_fetch_ranges``: one request
        per run of overlapping or adjacent ranges, each rounded out to the blocks
        (chunks) of the content check). ``urgent``: waited for now (``ObjectFiles.submit_many``)."""
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        start = ids * seq_len
        request, offset, nbytes, future = self._fetch_ranges(start, start + seq_len + 1, urgent)
        return _Fetch(ids, seq_len, request, offset, nbytes, future)

    def read_ahead(self, ids: np.ndarray, seq_len: int) -> None:
        """Fetch the windows of one step's samples ``ids`` in the background (returns at
        once; steps are fetched in the order given)."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size:
            with self._lock:
                self._queued.append((ids, int(seq_len)))
                self._launch()

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until every step read ahead has been fetched (a failed fetch counts as
        landed: its read raises); TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                busy = bool(self._queued)
                futures = [step.fetch.future for step in self._steps]
            if not busy and all(f.done() for f in futures):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"read-ahead of {self.url.shown} still in flight after {timeout} s"
                )
            time.sleep(0.005)

    def drop_read_ahead(self) -> None:
        """Forget every step read ahead (the loader moved: a reset, a resume)."""
        with self._lock:
            self._steps.clear()
            self._queued.clear()
            self._held = 0

    def _launch(self) -> None:
        """Start the queued steps that fit the budget (the first always fits). Under the lock."""
        budget = self.options.read_ahead_bytes
        while self._queued:
            ids, seq_len = self._queued[0]
            if self._held and self._held + ids.size * (seq_len + 1) * self.dtype.itemsize > budget:
                return
            self._queued.popleft()
            fetch = self._fetch(ids, seq_len)
            self._steps.append(_Step(fetch, ids.size))
            self._held += fetch.nbytes

    def window(self, i: int, seq_len: int) -> np.ndarray:
        return self.windows(np.array([i], dtype=np.int64), seq_len)[0]

    def windows(self, ids: np.ndarray, seq_len: int) -> np.ndarray:
        """Samples ``ids``: [len(ids), seq_len + 1], from the steps read ahead (waiting for
        bytes still on the way), the rest fetched now; all checked."""
        ids = np.asarray(ids, dtype=np.int64).ravel()
        n = self.num_samples(seq_len)
        out = np.empty((ids.size, seq_len + 1), dtype=self.dtype)
        if not ids.size:
            return out
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n:
            raise IndexError(
                f"sample ids must lie in [0, {n}) for seq_len {seq_len}, "
                f"found values in [{lo}, {hi}]."
            )
        rest = np.arange(ids.size)
        sources: list[tuple[_Fetch, np.ndarray, np.ndarray, _Step | None]] = []
        with self._lock:
            for step in self._steps:
                if not rest.size:
                    break
                if step.fetch.seq_len != seq_len:
                    continue
                pos, hit = step.fetch.find(ids[rest])
                if hit.any():
                    sources.append((step.fetch, rest[hit], pos[hit], step))
                    rest = rest[~hit]
        if rest.size:
            fetch = self._fetch(ids[rest], seq_len, urgent=True)
            sources.append((fetch, rest, fetch.find(ids[rest])[0], None))
        for fetch, rows, pos, _ in sources:
            fetch.fill(out, rows, pos)
        with self._lock:
            for _, rows, _, step in sources:
                if step is not None:
                    step.served += rows.size
            # Steps are read in order: a step served whole, and one partly served before
            # a later one was read from (left by a reset), will not be read again.
            hits = [step for *_, step in sources if step is not None]
            latest = max((self._steps.index(x) for x in hits if x in self._steps), default=-1)
            for k, step in enumerate(list(self._steps)):
                if step.served >= step.rows or (k < latest and step.served):
                    self._steps.remove(step)
                    self._held -= step.fetch.nbytes
            self._launch()
            self.served_bytes += out.nbytes
        return out

    def close(self) -> None:
        """Stop the fetch thread (and the cache's)."""
        self._files.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)  # queued lookups end, failing their reads

    # ------------------------------------------------------------------ blocks of check

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
        self,
        start: np.ndarray,
        stop: np.ndarray,
        urgent: bool = False,
        sums: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, int, Future]:
        """Start fetching token ranges ``[start[k], stop[k])`` (sorted by start): one
        request per run of overlapping or adjacent ranges, each rounded out to the blocks
        (chunks) of the content check (whole blocks, with their block checksums; else whole
        chunks), through the node cache when there is one. (each range's request, its
        offset in that request's tokens, the bytes requested, a Future of each request's
        tokens, checked.) ``urgent``: waited for now (``ObjectFiles.submit_many``).

        ``sums``: each range's own checksum (``span_sum``, kept with a packing index):
        then, without a node cache, the ranges are fetched exactly, not rounded out, and
        each is checked against its sum on arrival."""
        if sums is not None and self.verifies and self.cache is None:
            return self._fetch_summed(start, stop, sums, urgent)
        blocks = self.blocks if self.verifies else None
        chunk = self.chunk_tokens if self.verifies and blocks is None else None
        if blocks:
            first, last, a, b = self._block_cover(start, stop)
        elif chunk:
            a = start // chunk * chunk
            b = np.minimum(((stop - 1) // chunk + 1) * chunk, self.num_tokens)
        else:
            a, b = start, stop
        heads, tails, req_a, req_b, request = _runs(a, b)
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
                    zip((req_a // chunk).tolist(), ((req_b - 1) // chunk).tolist(), strict=True)
                )
            return request, offset, nbytes, self._cached(runs, urgent)

        def arrived(datas: list[list[memoryview]]) -> list[np.ndarray]:
            arrays = [np.frombuffer(d, dtype=self.dtype) for d in datas[0]]
            if blocks:
                for arr, sums, block in zip(arrays, datas[1], block_first, strict=True):
                    self._check_blocks(arr, np.frombuffer(sums, dtype="<u8"), block)
            elif chunk:
                for arr, x in zip(arrays, req_a_list, strict=True):
                    self._check_range(arr, x, chunk)
            return arrays

        return request, offset, nbytes, self._files.submit_many(reads, then=arrived, urgent=urgent)

    def _fetch_summed(
        self, start: np.ndarray, stop: np.ndarray, sums: np.ndarray, urgent: bool
    ) -> tuple[np.ndarray, np.ndarray, int, Future]:
        """``_fetch_ranges`` of ranges with their own checksums: exactly their tokens
        (ranges that overlap, touch or lie within ``SPAN_GAP_BYTES`` of each other in one
        request, the gap fetched too), each range hashed on arrival."""
        _, _, req_a, req_b, request = _runs(start, stop, SPAN_GAP_BYTES // self.dtype.itemsize)
        offset = start - req_a[request]
        item = self.dtype.itemsize
        nbytes = int((req_b - req_a).sum()) * item
        reads = [(TOKENS, (req_a * item).tolist(), (req_b * item).tolist())]
        seed = block_seed(self.fingerprint)
        spans = list(zip(request.tolist(), offset.tolist(), (stop - start).tolist(), strict=True))
        expected = np.asarray(sums).astype(np.uint64).tolist()
        firsts = start.tolist()

        def arrived(datas: list[list[memoryview]]) -> list[np.ndarray]:
            arrays = [np.frombuffer(d, dtype=self.dtype) for d in datas[0]]
            for (r, o, n), want, first in zip(spans, expected, firsts, strict=True):
                if xxhash.xxh3_64_intdigest(arrays[r][o : o + n], seed) != want:
                    raise StoreError(
                        f"token store {str(self.path)!r}: tokens [{first}, {first + n}) of "
                        f"{TOKENS} do not match their checksum in the packing index kept "
                        "with the store; an object was changed or corrupted after "
                        f"preparation. Run `zephon inspect {self.path} --check` to list "
                        "every bad chunk and block, and upload the store again from an "
                        "intact copy."
                    )
            return arrays

        return request, offset, nbytes, self._files.submit_many(reads, then=arrived, urgent=urgent)

    def read_spans(
        self, start: np.ndarray, stop: np.ndarray, sums: np.ndarray | None = None
    ) -> list[np.ndarray]:
        """Tokens ``[start[k], stop[k])`` for each k, fetched now (``_fetch_ranges``;
        ``sums``: each span's own checksum), checked: how packed samples (``job.packed``)
        read a store in object storage."""
        start = np.asarray(start, dtype=np.int64).ravel()
        stop = np.asarray(stop, dtype=np.int64).ravel()
        if not start.size:
            return []
        if int(start.min()) < 0 or int(stop.max()) > self.num_tokens or (stop < start).any():
            raise IndexError(f"token spans must lie in [0, {self.num_tokens}).")
        order = np.argsort(start, kind="stable")
        ordered = None if sums is None else np.asarray(sums).ravel()[order]
        request, offset, _, future = self._fetch_ranges(
            start[order], stop[order], urgent=True, sums=ordered
        )
        arrays = future.result()
        out: list[np.ndarray] = [np.empty(0, self.dtype)] * start.size
        lengths = (stop - start)[order].tolist()
        for k, r, o, n in zip(
            order.tolist(), request.tolist(), offset.tolist(), lengths, strict=True
        ):
            out[k] = arrays[r][o : o + n]
        return out

    # ------------------------------------------------------------------ the node cache

    def _block_size(self) -> tuple[int, int]:
        """(tokens per block (chunk) of content check, tokens one overlaps the next by)."""
        if self.blocks:
            return int(self.blocks["block_tokens"]), 1
        return self.chunk_tokens, 0

    def _span(self, block: int) -> tuple[int, int]:
        size, overlap = self._block_size()
        return block * size, min(block * size + size + overlap, self.num_tokens)

    def _from_cache(self, block: int) -> np.ndarray | None:
        """Block (chunk) ``block``'s tokens from the node cache, checked (None: not cached, or its
        file was bad: then removed)."""
        data = self.cache.get(block)
        if data is None:
            return None
        start, stop = self._span(block)
        want = (stop - start) * self.dtype.itemsize
        if self.blocks:
            good = len(data) == want + 8
            if good:
                tokens = np.frombuffer(data, dtype=self.dtype, count=stop - start)
                stored = int(np.frombuffer(data, dtype="<u8", offset=want)[0])
                digest = xxhash.xxh3_64_intdigest(tokens, block_seed(self.fingerprint))
                good = digest ^ self._place(block) == stored
        else:
            good = len(data) == want
            if good:
                tokens = np.frombuffer(data, dtype=self.dtype)
                good = xxhash.xxh3_64_intdigest(tokens) == int(self._sums[block])
        if not good:  # truncated, garbage or another block's: never served, fetched again
            self.cache.discard(block)
            return None
        self.cache.hit(len(data))
        return tokens

    def _place(self, block: int) -> int:
        """What a cached block's check value is keyed by: its place (the store's seed,
        the cache kind and the block index). The file holds the block checksum XOR this,
        so a file under another block's name (or kind, or store) fails its check."""
        place = f"{self.cache.kind}/{block}".encode()
        return xxhash.xxh3_64_intdigest(place, block_seed(self.fingerprint))

    def _cached(self, runs: list[tuple[int, int]], urgent: bool = False) -> Future:
        """A Future of the tokens of each run of blocks (``first``, ``last`` inclusive):
        the blocks the node cache holds (checked) read from disk, the rest fetched (one
        request per run of missing blocks, checked on arrival) and then cached. The disk
        work runs on the cache's thread, the fetches on the fetch thread."""
        out: Future = Future()
        size, overlap = self._block_size()
        item = self.dtype.itemsize
        got: dict[int, np.ndarray] = {}
        missing: list[list[int]] = []  # runs of blocks not cached: [first, last]

        def assemble() -> list[np.ndarray]:
            arrays = []
            for first, last in runs:
                run = [got[u][:size] for u in range(first, last)] + [got[last]]
                arrays.append(run[0] if len(run) == 1 else np.concatenate(run))
            return arrays

        def finish(fetched: Future) -> None:
            try:
                arrived: list[tuple[int, np.ndarray, bytes]] = fetched.result()
                for block, tokens, _ in arrived:
                    got[block] = tokens
                self.cache.put_many((block, data) for block, _, data in arrived)
                out.set_result(assemble())
            except BaseException as e:  # noqa: BLE001 - handed to the reader
                out.set_exception(e)

        def lookup() -> None:
            try:
                for first, last in runs:
                    for u in range(first, last + 1):
                        tokens = self._from_cache(u)
                        if tokens is not None:
                            got[u] = tokens
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
            """Check each fetched run (fetch thread) and cut it into its blocks."""
            cut = []
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
                    if sums is not None:  # the block checksum, keyed by the block's place
                        raw += np.array([int(sums[u - first]) ^ self._place(u)], "<u8").tobytes()
                    cut.append((u, tokens, raw))
            return cut

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

    def _check_range(self, arr: np.ndarray, first: int, size: int) -> None:
        """Hash every chunk of ``arr`` (tokens from ``first``, whole chunks)."""
        sums = self._sums
        for chunk in range(first // size, -(-(first + arr.size) // size)):
            lo = chunk * size - first
            if xxhash.xxh3_64_intdigest(arr[lo : lo + size]) != int(sums[chunk]):
                raise self.chunk_mismatch(chunk)
