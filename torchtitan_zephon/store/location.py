"""Where a store's bytes come from: a local folder, or a prefix in object storage.

Role: reading and writing object storage (how a location is named, parsed and printed
is ``store.urls``'). ``ObjectFiles`` reads
the files of a store prefix through obstore: whole files, and byte ranges in batches
with a bounded number of requests in flight, on one background thread; for
``zephon prepare`` it also lists a prefix (``listing``), streams an object to a local
file (``download``) and writes one (``upload``: multipart for large files).

Design:
- The library (obstore), credentials and the client's options: ``object_client``;
  faults and their messages: ``object_faults``.
- Integrity of a remote read: the ETag of every file is recorded when the store is
  opened and sent as ``If-Match`` on every read, so an object replaced while a job
  reads it is an error (naming the object), never a mix of two versions. ETags are
  not part of any fingerprint or data state: a run moves freely between a local copy
  and the bucket.

Invariant: a read returns exactly the bytes asked for of the object as it was at open,
or raises a StoreError naming the object (redacted) and what to do; no attempt waits
longer than ``request_timeout_s``, no request longer than ``limit_s`` (every attempt
and the backoff between them). A read that the endpoint stops answering fails within
``limit_s`` of when the endpoint went silent or the read was submitted, whichever is
later (sent while others wait, a request waits to ``limit_s`` after the last answer;
within ``limit_s`` of a failure for want of one, not at all), however many requests wait: a request that fails on every
attempt (no answer, an endpoint failing or refusing) fails at once, with its error,
every read of the store pending at that moment (their requests in flight cancelled,
the queued ones never started), and the other requests of its own read are cancelled.
Requests wait for one of ``max_requests`` slots in order, an ``urgent`` read's (what
a step waits for now, not read ahead) before the others: read-ahead never starves it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.object_client import (
    BACKOFF_S,
    DOWNLOAD_CHUNK,
    MAX_REQUESTS,
    REQUEST_TIMEOUT_S,
    RETRIES,
    UPLOAD_PART,
    RequestGate,
    client_options,
    serve_loop,
    stamp_ns,
    stop_loop,
)
from torchtitan_zephon.store.object_faults import request_failure, unanswered
from torchtitan_zephon.store.shards import byte_ranges
from torchtitan_zephon.store.urls import (
    ObjectURL,
    scrub,
)

_USED = False  # whether this process started an ``ObjectFiles`` thread (object_storage_used)


def object_storage_used() -> bool:
    """Whether this process has read or written object storage: obstore's runtime
    threads may then still run at interpreter exit (``cli.main.run`` leaves without
    tearing the interpreter down under them)."""
    return _USED


class ObjectFiles:
    """The files of one store prefix in object storage, read through obstore.

    ``open_file(name)`` records a file's size and ETag (one HEAD; the first one also
    checks the credentials); ``read(name)`` reads a whole (small) file;
    ``submit(name, starts, stops)`` starts range reads on the background thread and
    returns a Future of their bytes (one request each, at most ``max_requests`` in
    flight, ``If-Match`` the recorded ETag). ``fetched_bytes`` / ``requests`` count
    what was read. ``close()``, collecting it or interpreter exit stop the thread and
    close its loop, on that thread: a command ends with nothing of it left running."""

    def __init__(
        self,
        url: ObjectURL,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_requests: int = MAX_REQUESTS,
        retries: int = RETRIES,
    ) -> None:
        from obstore.store import from_url

        if request_timeout_s <= 0 or max_requests < 1 or retries < 0:
            raise StoreError(
                f"request_timeout_s must be > 0, max_requests >= 1 and retries >= 0, got "
                f"{request_timeout_s}, {max_requests} and {retries}."
            )
        self.url = url
        self.timeout_s = float(request_timeout_s)
        self.max_requests = int(max_requests)
        options = client_options(url, self.timeout_s)
        self.retries = int(retries)
        # Retries are obstore's (its classification of transient failures, per cloud),
        # bounded here: RETRIES attempts after the first, each within timeout_s, with
        # BACKOFF_S between; a request as a whole never waits longer than ``limit_s``.
        retry = {
            "max_retries": self.retries,
            "retry_timeout": timedelta(seconds=(self.retries + 1) * self.timeout_s),
            "backoff": {
                "init_backoff": timedelta(seconds=BACKOFF_S[0]),
                "max_backoff": timedelta(seconds=BACKOFF_S[1]),
                "base": 2.0,
            },
        }
        self.limit_s = (self.retries + 1) * (self.timeout_s + BACKOFF_S[1]) + 1.0
        try:
            self._store = from_url(url.text, client_options=options, retry_config=retry)
        except Exception as e:  # obstore's configuration errors: scrubbed, not passed on
            raise StoreError(f"cannot use {url.shown}: {scrub(str(e).splitlines()[0])}") from None
        self._root: Any = None  # the bucket's root, for names that start with "/"
        self._root_args = (url.root_text(), options, retry)
        self.etags: dict[str, str | None] = {}
        self.sizes: dict[str, int] = {}
        self.mtimes: dict[str, int] = {}
        self.joined: dict[str, tuple[list[str], list[int]]] = {}  # name -> (objects, bounds)
        self.fetched_bytes = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._gate: RequestGate | None = None
        self._reads: dict[asyncio.Task, list[StoreError | None]] = {}  # pending: why failed
        self._in_flight, self._heard = 0, 0.0  # requests sent; the endpoint's last answer
        self._silent_at: float | None = None  # when a request last failed for want of one
        self._stop: weakref.finalize | None = None

    # ------------------------------------------------------------------ the thread

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._gate = RequestGate(self.max_requests)  # used on the loop only
                # The thread holds no reference to self, so an unused ObjectFiles is
                # collected (its finalizer stops the thread); at interpreter exit the
                # finalizer runs too, before modules are torn down.
                self._thread = threading.Thread(
                    target=serve_loop, args=(loop,), name="zephon-fetch", daemon=True
                )
                self._thread.start()
                self._stop = weakref.finalize(self, stop_loop, loop, self._thread)
                global _USED
                _USED = True
                self._loop = loop
            return self._loop

    def close(self) -> None:
        """Stop the background thread and close its loop; requests in flight are
        cancelled (their futures raise CancelledError). Idempotent."""
        with self._lock:
            stop, self._loop = self._stop, None
        if stop is not None:
            stop()

    def _run(self, coro: Any) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._start())

    # ------------------------------------------------------------------ requests

    def _failure(self, e: BaseException, name: str, doing: str) -> StoreError:
        """A StoreError for a failed request (``object_faults.request_failure``)."""
        return request_failure(
            e, self.url, name, doing, opened=name in self.sizes, timeout_s=self.timeout_s,
            retries=self.retries,
        )  # fmt: skip

    def _where(self, name: str) -> tuple[Any, str]:
        """(obstore store, path) of the file ``name``: under the prefix, or, for a name
        that starts with ``/``, the key from the bucket's root (a token file read in place,
        ``ingest.token_files``)."""
        if not name.startswith("/"):
            return self._store, name
        if self._root is None:
            from obstore.store import from_url

            text, options, retry = self._root_args
            self._root = from_url(text, client_options=options, retry_config=retry)
        return self._root, name[1:]

    async def _head(self, name: str) -> dict[str, Any]:
        import obstore

        return await asyncio.wait_for(obstore.head_async(*self._where(name)), self.limit_s)

    def open_file(self, name: str) -> int:
        """Record the size and ETag of the file ``name``; its size in bytes."""
        try:
            meta = self._run(self._head(name)).result()
        except Exception as e:
            raise self._failure(e, name, "reading") from None
        self.sizes[name] = int(meta["size"])
        self.etags[name] = meta.get("e_tag")
        self.mtimes[name] = stamp_ns(meta.get("last_modified"))
        return self.sizes[name]

    def join(self, name: str, objects: Sequence[tuple[str, int]]) -> None:
        """Read ``objects`` ((name, size) in order) as one file ``name``, their
        concatenation (a sharded store's tokens, ``store.shards``): a range of it is read
        as the ranges of the objects it spans (``shards.byte_ranges``) and put back
        together. An object is not looked at before its first read; that read records its
        ETag, sent as ``If-Match`` on every later one (one shorter than its size fails
        the read that reaches past its end, naming it)."""
        names = [str(n) for n, _ in objects]
        bounds = [0]
        for _, size in objects:
            bounds.append(bounds[-1] + int(size))
        self.joined[name] = (names, bounds)
        self.sizes[name] = bounds[-1]

    def missing_store_reason(self) -> str:
        """Why the prefix holds no store: it is empty (or the bucket is missing), or what
        it holds instead (a few names)."""
        import obstore

        async def first() -> list[str]:
            stream = obstore.list(self._store, chunk_size=8)
            try:
                batch = await asyncio.wait_for(stream.__anext__(), self.limit_s)
            finally:
                del stream  # dropped here, on the loop, not left to interpreter exit
            return [str(m["path"]) for m in batch]

        try:
            names = self._run(first()).result()
        except StopAsyncIteration:
            return "nothing is stored under it"
        except Exception as e:
            raise self._failure(e, "", "listing") from None
        return f"it holds {', '.join(repr(n) for n in names[:8])}"

    def listing(self, under: str = "") -> list[dict[str, Any]]:
        """Every object under the prefix (and below ``under``, a name within it), in key
        order: ``name`` (relative to the prefix), ``size``, ``e_tag``, ``mtime_ns``."""
        import obstore

        prefix = self.url.prefix

        async def every() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = []
            stream = obstore.list(self._store, prefix=under or None, chunk_size=1000)
            while True:
                try:
                    batch = await asyncio.wait_for(stream.__anext__(), self.limit_s)
                except StopAsyncIteration:
                    return found
                for m in batch:
                    path = str(m["path"])
                    if prefix and path.startswith(prefix + "/"):  # some stores give full keys
                        path = path[len(prefix) + 1 :]
                    found.append({
                        "name": path,
                        "size": int(m["size"]),
                        "e_tag": m.get("e_tag"),
                        "mtime_ns": stamp_ns(m.get("last_modified")),
                    })  # fmt: skip

        try:
            return sorted(self._run(every()).result(), key=lambda m: m["name"])
        except Exception as e:
            raise self._failure(e, under, "listing") from None

    def download(
        self,
        name: str,
        dest: str | os.PathLike,
        size: int,
        e_tag: str | None,
        *,
        redo: str = "Run again once it stays put.",
    ) -> None:
        """Stream the object ``name`` (of ``size`` bytes, ``If-Match`` ``e_tag``) into the
        new local file ``dest``, a chunk at a time (memory: one chunk of
        ``DOWNLOAD_CHUNK`` bytes). ``redo``: what the error of an object changed since it
        was listed tells the user to do (the caller's words)."""
        import obstore
        from obstore.exceptions import PreconditionError

        async def fetch() -> int:
            options: dict[str, Any] = {"if_match": e_tag} if e_tag else {}
            result = await asyncio.wait_for(
                obstore.get_async(*self._where(name), options=options), self.limit_s
            )
            written = 0
            with open(dest, "wb") as fh:
                async for chunk in result.stream(min_chunk_size=DOWNLOAD_CHUNK):
                    fh.write(chunk)
                    written += len(chunk)
            return written

        changed = f"{self.url.child(name)} changed while it was read"
        try:
            written = self._run(fetch()).result()
        except PreconditionError:
            raise StoreError(
                f"{changed} (its ETag is no longer the one it had when listed). {redo}"
            ) from None
        except Exception as e:
            raise self._failure(e, name, "reading") from None
        with self._lock:
            self.fetched_bytes += written
            self.requests += 1
        if written != size:
            raise StoreError(
                f"{changed}: received {written} bytes, the listing says {size}. {redo}"
            )

    def upload(self, name: str, source: str | os.PathLike | bytes) -> None:
        """Write the object ``name`` from a local file (multipart, ``UPLOAD_PART`` bytes a
        part, when larger) or bytes; an object is visible whole or not at all."""
        from pathlib import Path

        import obstore

        body = Path(source) if isinstance(source, (str, os.PathLike)) else source

        async def put() -> None:
            await obstore.put_async(*self._where(name), body, chunk_size=UPLOAD_PART)

        try:
            self._run(put()).result()
        except Exception as e:
            raise self._failure(e, name, "writing") from None

    async def _get(
        self, name: str, start: int, stop: int, urgent: bool, read: list[StoreError | None]
    ) -> memoryview:
        import obstore

        options: dict[str, Any] = {"range": (int(start), int(stop))}
        etag = self.etags.get(name)
        if etag:
            options["if_match"] = etag
        assert self._gate is not None
        loop = asyncio.get_running_loop()

        async def get() -> memoryview:  # the endpoint answered: once get_async returns
            result = await obstore.get_async(*self._where(name), options=options)
            self._heard, self._silent_at = loop.time(), None
            if not etag:  # a joined object's first read: pinned from here on (join)
                self.etags.setdefault(name, result.meta.get("e_tag"))
            return memoryview(await result.bytes_async())

        for attempt in range(self.retries + 1):
            await self._gate.acquire(urgent)  # a wait bounded by _gather's early failures
            if read[0] is not None:  # its read failed meanwhile: never sent
                self._gate.release()
                raise asyncio.CancelledError
            self._in_flight, now = self._in_flight + 1, loop.time()  # then the silence rule:
            silent = now - (self._silent_at or -self.limit_s) < self.limit_s
            if self._in_flight == 1 and not silent:
                self._heard = max(self._heard, now)
            wait = 0.0 if silent else min(self.limit_s, self._heard + self.limit_s - now)
            try:
                data = await asyncio.wait_for(get(), max(wait, 0.0))
            except Exception as e:
                failed = self._failure(e, name, "reading")
                read[0] = read[0] or failed  # before the slot is freed: marks the read,
                if unanswered(failed):  # and every read pending, failed
                    self._silent_at = loop.time()
                    for why in self._reads.values():
                        why[0] = why[0] or failed
                raise failed from None
            finally:
                self._in_flight -= 1
                self._gate.release()
            if len(data) == stop - start:
                break
            with self._lock:  # a short body (a well-formed answer, too short): retried
                self.fetched_bytes += len(data)
                self.requests += 1
            if attempt < self.retries:
                await asyncio.sleep(min(BACKOFF_S[0] * 2**attempt, BACKOFF_S[1]))
        else:
            raise StoreError(
                f"{self.url.child(name)}: asked for bytes [{start}, {stop}), received "
                f"{len(data)}, {self.retries + 1} times: the object is shorter than the "
                "store's manifest says. Upload the store again."
            )
        with self._lock:
            self.fetched_bytes += len(data)
            self.requests += 1
        return data

    async def _gather(
        self, reads: list[tuple[str, list[int], list[int]]], then: Any, urgent: bool
    ) -> Any:
        """One read's requests: the first failure cancels the others; one for want of an
        endpoint (``object_faults.unanswered``) also fails every other read pending, at once."""
        me = asyncio.current_task()
        assert me is not None
        read: list[StoreError | None] = [None]
        self._reads[me] = read
        tasks = [
            asyncio.ensure_future(self._get(name, a, b, urgent, read))
            for name, starts, stops in reads
            for a, b in zip(starts, stops, strict=True)
        ]
        try:
            if tasks:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                failed = task.exception() if task.done() and not task.cancelled() else None
                if failed is not None:
                    for other, why in self._reads.items():
                        if other is not me and why[0] is not None:
                            other.cancel()  # failed by this request (_get)
                    raise failed
                if task.cancelled():
                    raise asyncio.CancelledError
        except asyncio.CancelledError:
            if read[0] is None:  # closed
                raise
            raise type(read[0])(str(read[0])) from None  # failed early: a request's error
        finally:
            self._reads.pop(me, None)
            for task in tasks:
                task.cancel()
        found, k = [], 0
        for _, starts, _ in reads:
            found.append([t.result() for t in tasks[k : k + len(starts)]])
            k += len(starts)
        return found if then is None else then(found)

    def submit_many(
        self,
        reads: Sequence[tuple[str, Sequence[int], Sequence[int]]],
        then: Any = None,
        *,
        urgent: bool = False,
    ) -> Future:
        """Start reading, for each ``(name, starts, stops)`` of ``reads``, the byte ranges
        ``[starts[k], stops[k])`` of ``name`` (one request each, all at once); a Future of
        their bytes (per read, a list of memoryviews in order), or of ``then(bytes)`` (run
        on the background thread: a content check, say). ``urgent``: a read waited for
        now, whose requests get free slots before those of reads ahead."""
        listed = [(name, list(a), list(b)) for name, a, b in reads]
        if any(name in self.joined for name, _, _ in listed):
            return self._run(self._gather_joined(listed, then, urgent))
        return self._run(self._gather(listed, then, urgent))

    async def _gather_joined(
        self, reads: list[tuple[str, list[int], list[int]]], then: Any, urgent: bool
    ) -> Any:
        """``_gather`` of reads of which some name a joined file: each of its ranges read
        as the ranges of the objects it spans, then put back together."""
        expanded: list[tuple[str, list[int], list[int]]] = []
        shape: list[list[int]] = []  # per read, per range: how many pieces it was cut into
        for name, starts, stops in reads:
            if name not in self.joined:
                expanded.append((name, starts, stops))
                shape.append([])
                continue
            names, bounds = self.joined[name]
            counts = []
            for a, b in zip(starts, stops, strict=True):
                pieces = byte_ranges(bounds, a, b)
                expanded.extend((names[k], [lo], [hi]) for k, lo, hi in pieces)
                counts.append(len(pieces))
            shape.append(counts)
        found = await self._gather(expanded, None, urgent)
        out, k = [], 0
        for (name, _, _), counts in zip(reads, shape, strict=True):
            if name not in self.joined:
                out.append(found[k])
                k += 1
                continue
            ranges = []
            for n in counts:
                views = [found[k + j][0] for j in range(n)]
                ranges.append(views[0] if n == 1 else memoryview(b"".join(views)))  # 0: b""
                k += n
            out.append(ranges)
        return out if then is None else then(out)

    def submit(
        self,
        name: str,
        starts: Sequence[int],
        stops: Sequence[int],
        then: Any = None,
        *,
        urgent: bool = False,
    ) -> Future:
        """``submit_many`` of one file: a Future of its ranges' bytes (or of ``then`` of
        them)."""
        done = None if then is None else (lambda found: then(found[0]))
        future = self.submit_many([(name, starts, stops)], then=done, urgent=urgent)
        if then is not None:
            return future
        out: Future = Future()
        future.add_done_callback(
            lambda f: (
                out.set_exception(f.exception()) if f.exception() else out.set_result(f.result()[0])
            )
        )
        return out

    def read(self, name: str) -> memoryview:
        """The whole file ``name`` (opened first when it was not), in one request."""
        size = self.sizes[name] if name in self.sizes else self.open_file(name)
        if size == 0:
            return memoryview(b"")
        return self.submit(name, [0], [size], urgent=True).result()[0]
