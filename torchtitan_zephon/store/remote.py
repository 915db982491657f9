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
the unit of the content check, neighbouring and overlapping ranges coalesced into one
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

Node cache: ``remote_units``.

Invariants:
- Row k of ``windows(ids, seq_len)`` equals the local store's ``windows`` row for the
  same store content, and every token served was fetched with ``If-Match`` the ETag
  recorded at open (or read from the node cache of this fingerprint) and checked
  against its block's (or chunk's) checksum before it is served; a mismatch of fetched
  bytes is a StoreError naming the store and the block (chunk), raised by the read that
  needs it (a bad cached file is a miss, not an error).
- Opening reads the manifest and blocks.json (with block checksums; HEADs give the
  other files' sizes) or the manifest and checksums.bin (without), and nothing of
  tokens.bin, blocks.bin or doc_offsets.bin (fetched on first use, by range or, for
  ``check``, whole).
- ``fetched_bytes`` counts every byte read from object storage (manifest and checksums
  of either kind included), never a node-cache hit; ``served_bytes`` the bytes of the
  windows served.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from torchtitan_zephon.store.cache import NodeCache
from torchtitan_zephon.store.format import (
    BLOCKS,
    CONTENT,
    DOC_OFFSETS,
    DTYPES,
    MANIFEST,
    REPREPARE,
    STORE_FILES,
    TOKENS,
    ContentReport,
    StoreError,
    UncheckedStoreWarning,
    check_file_size,
    num_chunks,
)
from torchtitan_zephon.store.location import ObjectFiles
from torchtitan_zephon.store.object_faults import MissingBucket, MissingObject
from torchtitan_zephon.store.opening import (
    check_content,
    check_manifest,
)
from torchtitan_zephon.store.reader import TokenStore
from torchtitan_zephon.store.remote_options import (
    CACHE_BYTES,
    READ_AHEAD_BYTES,
    READ_AHEAD_STEPS,
    RemoteOptions,
)
from torchtitan_zephon.store.remote_units import (
    _Fetch,
    _open_blocks,
    _read_checksums,
    _RemoteUnits,
    _Step,
)
from torchtitan_zephon.store.urls import ObjectURL

# RemoteOptions and its defaults live in remote_options; importable from here too.
__all__ = [
    "CACHE_BYTES",
    "READ_AHEAD_BYTES",
    "READ_AHEAD_STEPS",
    "RemoteOptions",
    "RemoteTokenStore",
]


class RemoteTokenStore(_RemoteUnits, TokenStore, reads_object_urls=True):
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
        for name, kind, count in (
            (TOKENS, dtype, num_tokens),
            (DOC_OFFSETS, np.dtype("<i8"), int(manifest["num_documents"])),
        ):
            try:
                size = files.open_file(name)
            except MissingObject:
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
        store._files = files
        store.url = url
        store.options = options
        store.blocks = blocks
        if blocks is not None:
            store.num_chunks = num_chunks(num_tokens, store.chunk_tokens)
            store.verifies = bool(verify)
        if options.cache_bytes > 0 and store.verifies:  # unchecked units are never cached
            kind = f"blocks-{blocks['block_tokens']}" if blocks else f"chunks-{store.chunk_tokens}"
            unit_tokens = int(blocks["block_tokens"]) + 1 if blocks else store.chunk_tokens
            unit = unit_tokens * store.dtype.itemsize + 8  # the largest unit file, and its sum
            if options.cache_bytes < unit:
                warnings.warn(
                    f"zephon.cache_bytes = {options.cache_bytes} is smaller than one cached "
                    f"unit of {url.shown!r} ({unit} bytes: a {kind} unit): the node cache "
                    "will hold nothing. Raise --zephon.cache_bytes, or set 0 to turn it off.",
                    stacklevel=4,
                )
            store.cache = NodeCache(options.cache_dir, store.fingerprint, kind, options.cache_bytes)
            store._pool = ThreadPoolExecutor(1, thread_name_prefix="zephon-cache")
        return store

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._doc_offsets: np.ndarray | None = None
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
        per run of overlapping or adjacent ranges, each rounded out to the unit of the
        content check). ``urgent``: waited for now (``ObjectFiles.submit_many``)."""
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
        parts: list[tuple[_Fetch, np.ndarray, np.ndarray, _Step | None]] = []
        with self._lock:
            for step in self._steps:
                if not rest.size:
                    break
                if step.fetch.seq_len != seq_len:
                    continue
                pos, hit = step.fetch.find(ids[rest])
                if hit.any():
                    parts.append((step.fetch, rest[hit], pos[hit], step))
                    rest = rest[~hit]
        if rest.size:
            fetch = self._fetch(ids[rest], seq_len, urgent=True)
            parts.append((fetch, rest, fetch.find(ids[rest])[0], None))
        for fetch, rows, pos, _ in parts:
            fetch.fill(out, rows, pos)
        with self._lock:
            for _, rows, _, step in parts:
                if step is not None:
                    step.served += rows.size
            # Steps are read in order: a step served whole, and one partly served before
            # a later one was read from (left by a reset), will not be read again.
            hits = [step for *_, step in parts if step is not None]
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
