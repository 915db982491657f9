"""The object-storage client's parts: its options (timeouts, plain http only to a
loopback endpoint or with AWS_ALLOW_HTTP), the background thread its event loop runs
on (started and stopped by ``location.ObjectFiles``), and the gate that bounds the
requests in flight, a step's own reads first.

One library, obstore (the Rust ``object_store`` crate behind a small Python API), for
``s3://``, ``gs://`` and ``az://``: its reads release the GIL, it batches and
parallelises range requests natively, and each cloud's standard credential chain
(environment variables, web identity / workload identity, container and instance
metadata) is built in. fsspec (s3fs, gcsfs, adlfs) was the alternative: three
separately maintained back ends with their own options and credential rules, and
Python-level asyncio per request. ``file://`` URLs are local folders (memory-mapped).

Credentials: each cloud's standard environment (``AWS_*``, ``GOOGLE_*``,
``AZURE_*``) read by obstore; an S3-compatible endpoint is ``AWS_ENDPOINT_URL``.
Plain http is allowed for a loopback endpoint (127.0.0.1, ::1, localhost) without
opt-in, elsewhere only with ``AWS_ALLOW_HTTP=true``. Credential discovery and every
request are time-limited (``request_timeout_s`` per attempt); the first request of a
store is its credential check, and a failure there names the variables looked for.

Invariant: a loop runs, and is closed, on its own thread; the gate never admits more
than its size, and an urgent waiter goes before every non-urgent one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import threading
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from torchtitan_zephon.store.format import StoreError
from torchtitan_zephon.store.urls import ObjectURL, redact

REQUEST_TIMEOUT_S = 30.0
"""Time limit of one attempt of a request (credential discovery included)."""
RETRIES = 4
"""Attempts after the first for a transient failure: 500 / 502 / 503 / 504, throttling
(429, S3's 503 SlowDown), an attempt over its time limit, a reset or refused connection,
a body cut short."""
BACKOFF_S = (0.1, 2.0)
"""First and largest wait before a retry (doubling, with jitter: obstore's backoff)."""
MAX_REQUESTS = 16
"""Range requests in flight per store, at most."""
DOWNLOAD_CHUNK = 8 << 20
"""Bytes held in memory at a time while an object streams to a local file."""
UPLOAD_PART = 16 << 20
"""Part size of a multipart upload (files larger than this are uploaded in parts)."""


class RequestGate:
    """``size`` slots for requests, on the fetch thread's loop: a slot freed goes to the
    oldest urgent waiter, else to the oldest other one."""

    def __init__(self, size: int) -> None:
        from collections import deque

        self.free = size
        self.waiting: tuple[Any, Any] = (deque(), deque())  # urgent, read ahead

    async def acquire(self, urgent: bool) -> None:
        if self.free and not any(self.waiting):
            self.free -= 1
            return
        slot = asyncio.get_running_loop().create_future()
        self.waiting[0 if urgent else 1].append(slot)
        try:
            await slot
        except asyncio.CancelledError:  # a cancelled waiter's slot is skipped by release
            if slot.done() and not slot.cancelled():  # given the slot, then cancelled
                self.release()
            raise

    def release(self) -> None:
        for queue in self.waiting:
            while queue:
                slot = queue.popleft()
                if not slot.done():
                    slot.set_result(None)
                    return
        self.free += 1


def stamp_ns(stamp: Any) -> int:
    """An object's modification time (a datetime) in whole nanoseconds (0: none given)."""
    if stamp is None:
        return 0
    whole = int(stamp.timestamp())
    return whole * 1_000_000_000 + stamp.microsecond * 1000


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def client_options(url: ObjectURL, timeout_s: float) -> dict[str, Any]:
    # Each attempt is limited to timeout_s by obstore (then retried, see RETRIES).
    options: dict[str, Any] = {
        "timeout": timedelta(seconds=timeout_s),
        "connect_timeout": timedelta(seconds=min(5.0, timeout_s)),
    }
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
    if url.scheme == "s3" and endpoint.lower().startswith("http://"):
        allowed = os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true"
        if not (allowed or _loopback(endpoint)):
            raise StoreError(
                f"AWS_ENDPOINT_URL {redact(endpoint)!r} is plain http on a host that is not "
                "loopback: the store would be read unencrypted. Use https, or set "
                "AWS_ALLOW_HTTP=true to accept it."
            )
        options["allow_http"] = True
    return options


def serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The body of an ``ObjectFiles`` thread: run ``loop`` until stopped, then let its
    cancelled tasks finish and close it (on this thread, where it ran)."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=1.0))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """Cancel the tasks of an ``ObjectFiles`` loop, stop it, and wait for its thread."""

    def shut() -> None:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.call_soon(loop.stop)  # after the cancelled tasks ran their handlers

    try:
        loop.call_soon_threadsafe(shut)
    except RuntimeError:  # already closed
        return
    if thread is not threading.current_thread():
        thread.join(timeout=5)
