"""Packed samples from a store in object storage: the tokens of their pieces read by
range, ahead of the plan.

Role: ``RemoteSpans(store)`` reads token spans ``[begin, begin + take)`` (the pieces of
packed samples, ``job.packed``) from a ``store.remote.RemoteTokenStore``, which is not
memory-mapped. ``announce(begin, take)`` starts fetching one future step's spans in the
background (the loader's read-ahead, ``job.loader``, through
``PackedSource.read_ahead``); ``read(begin, take)`` serves the spans announced
(waiting for those still on the way) and fetches the others now. Both go through the
store's ``_fetch_ranges``: neighbouring and overlapping spans coalesced into one
request, rounded out to whole blocks (chunks), through the node cache, checked on
arrival; or, when the packing index keeps its pieces' spans (``job.packing.piece_spans``)
and there is no node cache, exactly the spans' tokens, each checked against its own
checksum (``zephon bench corpus``: 1.0x bytes fetched per byte trained, not 2.1-2.3x). A step whose bytes would take those held past the store's
``read_ahead_bytes`` is not read ahead (its spans are fetched when read); a step's bytes
are freed once each of its spans was served, or once a later step was read from (what
a reset leaves); ``drop()`` forgets every step announced. ``announce_later(keys,
spans)`` announces a step from a thread of its own, in order, once ``spans(keys)``
found its spans: the packed source's index lookups, a request each, leave the loader's
thread (``zephon bench corpus`` measured 0.7 s of them in a first batch); a read of a
step waits for its announcement (``wait_for``), so no span is fetched twice.

Invariant: ``read`` returns exactly the store's tokens of each span, concatenated, and
every token of it was checked against its block's (chunk's) checksum, or its span's
kept checksum, before it is served (``_fetch_ranges`` checks what arrives; a mismatch is
a StoreError raised by the read that needs it).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np


class _Announced:
    """One step's spans being fetched: its Future (each request's tokens), its bytes,
    and how many of its spans were not served yet."""

    def __init__(self, future: Future, nbytes: int, spans: int) -> None:
        self.future, self.nbytes, self.left, self.served = future, nbytes, spans, 0


class RemoteSpans:
    """Token spans of a store in object storage, read ahead by step (module docstring)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._steps: deque[_Announced] = deque()  # oldest first
        # (begin, take) -> [(its step, its request, its offset in that request's tokens)]
        self._spans: dict[tuple[int, int], list[tuple[_Announced, int, int]]] = {}
        self._held = 0
        # Steps to announce once their spans are looked up (``announce_later``), in order.
        self._later: deque[tuple[np.ndarray, Callable[[np.ndarray], Any], Future]] = deque()
        self._pending: list[tuple[np.ndarray, Future]] = []
        self._worker: threading.Thread | None = None

    def announce_later(
        self, keys: np.ndarray, spans: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    ) -> None:
        """``announce(*spans(keys))`` on a thread of this reader, in the order asked (returns
        at once): finding a step's spans (a packed index and document offsets read by
        page, a request each) leaves the caller's thread too. A read of any of ``keys``
        waits for it first (``wait_for``)."""
        keys = np.array(keys, dtype=np.int64).ravel()
        future: Future = Future()
        with self._lock:
            self._later.append((keys, spans, future))
            self._pending.append((keys, future))
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._announce_queued, name="zephon-packed-ahead", daemon=True
                )
                self._worker.start()

    def _announce_queued(self) -> None:
        while True:
            with self._lock:
                if not self._later:
                    self._worker = None  # a later announce_later starts another
                    return
                keys, spans, future = self._later.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self.announce(*spans(keys))
                future.set_result(None)
            except BaseException as e:  # the read of these keys fetches them and says why
                future.set_exception(e)

    def wait_for(self, keys: np.ndarray) -> None:
        """Wait until the steps announced later that hold any of ``keys`` are announced (a
        failed one is left to the read, which fetches what it lacks and raises itself)."""
        keys = np.asarray(keys, dtype=np.int64).ravel()
        with self._lock:
            self._pending = [(k, f) for k, f in self._pending if not f.done()]
            pending = list(self._pending)
        for k, future in pending:
            if np.isin(keys, k).any():
                try:
                    future.result()
                except Exception:
                    pass

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until every step asked for is announced and its spans have landed (a
        failed fetch counts as landed: its read raises); TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                busy = bool(self._later) or self._worker is not None
                futures = [step.future for step in self._steps]
            if not busy and all(f.done() for f in futures):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"packed read-ahead still in flight after {timeout} s")
            time.sleep(0.005)

    @property
    def held_bytes(self) -> int:
        """Bytes of the steps read ahead and not yet freed."""
        return self._held

    def announce(self, begin: np.ndarray, take: np.ndarray, sums: np.ndarray | None = None) -> None:
        """Fetch spans ``[begin[k], begin[k] + take[k])`` in the background (returns at
        once), unless that would hold more than the store's ``read_ahead_bytes``;
        ``sums``: each span's own checksum (then fetched exactly, ``_fetch_ranges``)."""
        begin = np.asarray(begin, dtype=np.int64).ravel()
        take = np.asarray(take, dtype=np.int64).ravel()
        if not begin.size:
            return
        budget = int(self.store.options.read_ahead_bytes)
        estimate = int(take.sum()) * self.store.dtype.itemsize
        with self._lock:
            if self._held and self._held + estimate > budget:
                return  # read when asked for
            order = np.lexsort((take, begin))
            start = begin[order]
            ordered = None if sums is None else np.asarray(sums).ravel()[order]
            request, offset, nbytes, future = self.store._fetch_ranges(
                start, start + take[order], sums=ordered
            )
            step = _Announced(future, nbytes, begin.size)
            self._steps.append(step)
            self._held += nbytes
            for b, t, r, o in zip(
                start.tolist(), take[order].tolist(), request.tolist(), offset.tolist(), strict=True
            ):
                self._spans.setdefault((b, t), []).append((step, r, o))

    def read(
        self, begin: np.ndarray, take: np.ndarray, sums: np.ndarray | None = None
    ) -> np.ndarray:
        """The store's tokens of spans ``[begin[k], begin[k] + take[k])``, concatenated:
        from the steps announced where they are there, the rest fetched now; checked
        (``sums``: each span's own checksum)."""
        begin = np.asarray(begin, dtype=np.int64).ravel()
        take = np.asarray(take, dtype=np.int64).ravel()
        parts: list[np.ndarray | None] = [None] * begin.size
        hits: list[tuple[int, _Announced, int, int, int]] = []
        missing: list[int] = []
        with self._lock:
            for k, (b, t) in enumerate(zip(begin.tolist(), take.tolist(), strict=True)):
                found = self._spans.get((b, t))
                if not found:
                    missing.append(k)
                    continue
                step, r, o = found.pop(0)
                if not found:
                    del self._spans[(b, t)]
                step.left -= 1
                step.served += 1
                hits.append((k, step, r, o, t))
        try:
            for k, step, r, o, t in hits:
                parts[k] = step.future.result()[r][o : o + t]
            if missing:
                at = np.asarray(missing, dtype=np.int64)
                fetched = self.store.read_spans(
                    begin[at], begin[at] + take[at], None if sums is None else sums[at]
                )
                for k, tokens in zip(missing, fetched, strict=True):
                    parts[k] = tokens
        finally:
            self._free({id(step) for _, step, *_ in hits})
        if not parts:
            return np.empty(0, dtype=self.store.dtype)
        return np.concatenate(parts)  # type: ignore[arg-type]

    def _free(self, read_from: set[int]) -> None:
        """Forget the steps served whole, and those partly served before a later step
        that was just read from (left by a reset)."""
        with self._lock:
            latest = max(
                (k for k, step in enumerate(self._steps) if id(step) in read_from), default=-1
            )
            for k, step in enumerate(list(self._steps)):
                if step.left <= 0 or (k < latest and step.served):
                    self._forget(step)

    def _forget(self, step: _Announced) -> None:
        self._steps.remove(step)
        self._held -= step.nbytes
        for key in [k for k, v in self._spans.items() if any(s is step for s, _, _ in v)]:
            kept = [x for x in self._spans[key] if x[0] is not step]
            if kept:
                self._spans[key] = kept
            else:
                del self._spans[key]

    def drop(self) -> None:
        """Forget every step announced (the loader moved: a reset, a resume), those
        still to be announced included."""
        with self._lock:
            later = [future for _, _, future in self._later]
            self._later.clear()
            running = [f for _, f in self._pending if f not in later]
            self._pending = []
        for future in later:
            future.cancel()
        for future in running:  # at most one: let it land, then forget it with the rest
            try:
                future.result()
            except Exception:
                pass
        with self._lock:
            self._steps.clear()
            self._spans.clear()
            self._held = 0
