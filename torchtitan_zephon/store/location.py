"""Where a store's bytes come from: a local folder, or a prefix in object storage.

Role: the one owner of locations. ``is_url`` tells a URL from a local path (a URL is
never taken as a path: ``Path("s3://b/x")`` would silently become the folder ``s3:``);
``parse_url`` checks one (scheme, bucket, prefix); ``redact`` is how a URL is printed
(query strings, which may hold an Azure SAS token, never are); ``refuse_url`` is what
a command or setting that takes local paths only says to a URL. ``ObjectFiles`` reads
the files of a store prefix through obstore: whole files, and byte ranges in batches
with a bounded number of requests in flight, on one background thread; for
``zephon prepare`` it also lists a prefix (``listing``), streams an object to a local
file (``download``) and writes one (``upload``: multipart for large files).

Design:
- One library, obstore (the Rust ``object_store`` crate behind a small Python API), for
  ``s3://``, ``gs://`` and ``az://``: its reads release the GIL, it batches and
  parallelises range requests natively, and each cloud's standard credential chain
  (environment variables, web identity / workload identity, container and instance
  metadata) is built in. fsspec (s3fs, gcsfs, adlfs) was the alternative: three
  separately maintained back ends with their own options and credential rules, and
  Python-level asyncio per request. ``file://`` URLs are local folders (memory-mapped).
- Credentials: each cloud's standard environment (``AWS_*``, ``GOOGLE_*``,
  ``AZURE_*``) read by obstore; an S3-compatible endpoint is ``AWS_ENDPOINT_URL``.
  Plain http is allowed for a loopback endpoint (127.0.0.1, ::1, localhost) without
  opt-in, elsewhere only with ``AWS_ALLOW_HTTP=true``. Credential discovery and every
  request are time-limited (``request_timeout_s`` per attempt); the first request of a
  store is its credential check, and a failure there names the variables looked for.
- Faults: transient failures (500/502/503/504, throttling, an attempt over its time
  limit, a reset connection, a body cut short) are retried by obstore, with exponential
  backoff and jitter, ``RETRIES`` times after the first attempt (obstore knows each
  cloud's transient answers); a well-formed answer shorter than asked is retried here the
  same number of times. What cannot get better by waiting stops at once with an error
  naming the object and what to do: 403, a missing object or bucket, an object changed
  since open (412 on ``If-Match``), missing credentials.
- Secrets never reach a message: obstore's error texts (which print request URLs) are
  not passed on; messages are written here from the error's kind, with URLs redacted
  and the values of the secret variables scrubbed.
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
later, however many requests are queued ahead of it: a request that fails on every
attempt (no answer, an endpoint failing or refusing) fails at once, with its error,
every read of the store pending at that moment (their requests in flight cancelled,
the queued ones never started), and the other requests of its own read are cancelled.
Requests wait for one of ``max_requests`` slots in order, an ``urgent`` read's (what
a step waits for now, not read ahead) before the others: read-ahead never starves it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from torchtitan_zephon.store.format import StoreError

URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
OBJECT_SCHEMES = ("s3", "gs", "az")
SCHEMES = (*OBJECT_SCHEMES, "file")
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

CREDENTIAL_VARIABLES = {
    "s3": (
        "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), "
        "AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, AWS_CONTAINER_CREDENTIALS_RELATIVE_URI "
        "or _FULL_URI, then the instance metadata service (AWS_ENDPOINT_URL for an "
        "S3-compatible endpoint; AWS_SKIP_SIGNATURE=true for a public bucket)"
    ),
    "gs": (
        "GOOGLE_SERVICE_ACCOUNT (or GOOGLE_SERVICE_ACCOUNT_PATH / GOOGLE_SERVICE_ACCOUNT_KEY), "
        "GOOGLE_APPLICATION_CREDENTIALS, then the instance metadata service"
    ),
    "az": (
        "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY, "
        "or AZURE_CLIENT_ID + AZURE_CLIENT_SECRET + AZURE_TENANT_ID (or a federated token "
        "file), then the instance metadata service"
    ),
}
SECRET_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
)


class MissingObject(StoreError):
    """An object (or its bucket) that does not exist."""


class _Unanswered(StoreError):
    """A request that failed on every attempt for want of a working endpoint (no answer,
    failing or throttling answers, a refused or reset connection): it fails the other
    reads pending (``ObjectFiles``)."""


class _Gate:
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


class MissingBucket(MissingObject):
    """The bucket (container) itself does not exist."""


def is_url(value: str | os.PathLike) -> bool:
    """True when ``value`` is written as a URL (``scheme://...``), whatever the scheme."""
    return isinstance(value, str) and URL_RE.match(value) is not None


_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):/(?!/)")


def mistyped_url(value: Any) -> str | None:
    """The URL meant by a location written as a URL of a scheme zephon reads with one
    slash (``s3:/bucket/q`` -> ``s3://bucket/q``), else None."""
    m = _ONE_SLASH.match(value) if isinstance(value, str) else None
    if m is None or m.group(1).lower() not in SCHEMES:
        return None
    scheme = m.group(1)
    return f"{scheme}://{'/' if scheme.lower() == 'file' else ''}{value[m.end() :]}"


def refuse_mistyped_url(value: Any, what: str) -> None:
    """A StoreError for a ``mistyped_url``, which would otherwise be taken as the local
    path ``./s3:/bucket/q``; ``what`` names the option or argument."""
    fixed = mistyped_url(value)
    if fixed is None:
        return
    scheme = fixed.split(":", 1)[0]
    raise StoreError(
        f"{what} {redact(value)!r} starts with the URL scheme {scheme}: and one slash; a URL "
        f"has two, and zephon never takes it as a local path. Did you mean {redact(fixed)!r}?"
    )


def redact(value: str) -> str:
    """``value`` as it may be printed: the query string of any URL in it (a SAS token,
    a signature) replaced by ``?<redacted>``, and any user info (``user:password@``)
    by ``<redacted>@``."""
    value = re.sub(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)[^\s/?@'\"]*@", r"\1<redacted>@", value)
    return re.sub(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s?'\"]*)\?[^\s'\"]*", r"\1?<redacted>", value)


def scrub(text: str) -> str:
    """``text`` with URLs redacted and the value of every secret variable removed."""
    text = redact(text)
    for name in SECRET_VARIABLES:
        secret = os.environ.get(name, "")
        if len(secret) >= 4:
            text = text.replace(secret, f"<{name}>")
    return text


@dataclass(frozen=True)
class ObjectURL:
    """A checked object-storage URL: ``scheme://bucket/prefix`` (no trailing slash)."""

    scheme: str
    bucket: str
    prefix: str
    text: str  # as given, for obstore (may hold a query string: never printed)

    @property
    def shown(self) -> str:
        """The URL as messages print it (redacted)."""
        return redact(self.text.rstrip("/"))

    def child(self, name: str) -> str:
        """The shown URL of the file ``name`` under the prefix."""
        return f"{self.shown.split('?')[0]}/{name}"


def parse_url(value: str, what: str = "a store", *, pattern: bool = False) -> ObjectURL | str:
    """The object URL ``value`` names, or the local path of a ``file://`` URL; a
    StoreError for an unknown scheme, credentials in the URL, or a URL without bucket
    or (unless ``pattern``: raw inputs, a glob or a whole bucket allowed) prefix."""
    m = URL_RE.match(value)
    if m is None:
        raise StoreError(f"{redact(value)!r} is not a URL.")
    scheme = m.group(1).lower()
    if scheme not in SCHEMES:
        raise StoreError(
            f"{what} {redact(value)!r} has the URL scheme {scheme!r}, which zephon does not "
            f"read: expected one of {', '.join(s + '://' for s in SCHEMES)}, or a local path."
        )
    parts = urlsplit(value)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise StoreError(
                f"{what} {redact(value)!r}: a file:// URL names a local absolute path, "
                "file:///path/to/store; found none."
            )
        return parts.path
    bucket, prefix = parts.netloc, parts.path.strip("/")
    kind = "container" if scheme == "az" else "bucket"
    if "@" in bucket:
        raise StoreError(
            f"{what} {redact(value)!r} holds credentials (user info before '@'): zephon never "
            f"reads them from a URL. Set them in the cloud's environment "
            f"({CREDENTIAL_VARIABLES[scheme]}) and name it "
            f"{scheme}://{kind.upper()}/PREFIX."
        )
    if not bucket:
        raise StoreError(
            f"{what} {redact(value)!r} names no {kind}: expected {scheme}://{kind.upper()}/PREFIX."
        )
    if pattern:
        return ObjectURL(scheme, bucket, prefix, value)
    if not prefix:
        raise StoreError(
            f"{what} {redact(value)!r} names a whole {kind}, not a store in it: expected "
            f"{scheme}://{bucket}/PREFIX, the prefix the store's files were uploaded under."
        )
    if set("*?[") & set(prefix):
        raise StoreError(
            f"{what} {redact(value)!r} is a pattern; a store is one prefix: name it without "
            "wildcards."
        )
    return ObjectURL(scheme, bucket, prefix, value)


def refuse_url(value: str, what: str, instead: str) -> None:
    """Raise a StoreError when ``value`` is a URL where only a local path is read:
    ``what`` names the option, ``instead`` says what to do."""
    if is_url(value) and not value.lower().startswith("file://"):
        raise StoreError(
            f"{what} {redact(value)!r} is a URL; {what} takes a local path here (a URL is "
            f"never taken as a path). {instead}"
        )


def local_path(value: str, what: str = "the path") -> str:
    """The local path of a ``file://`` URL, ``value`` itself otherwise (a StoreError for a
    URL with one slash: ``refuse_mistyped_url``)."""
    refuse_mistyped_url(value, what)
    if value.lower().startswith("file://"):
        found = parse_url(value)
        assert isinstance(found, str)
        return found
    return value


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


def _client_options(url: ObjectURL, timeout_s: float) -> dict[str, Any]:
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


_USED = False
"""Whether this process started an ``ObjectFiles`` thread (``object_storage_used``)."""


def object_storage_used() -> bool:
    """Whether this process has read or written object storage: obstore's runtime
    threads may then still run at interpreter exit (``cli.main.run`` leaves without
    tearing the interpreter down under them)."""
    return _USED


def _serve(loop: asyncio.AbstractEventLoop) -> None:
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


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
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


class ObjectFiles:
    """The files of one store prefix in object storage, read through obstore.

    ``open_file(name)`` records a file's size and ETag (one HEAD; the first one also
    checks the credentials); ``read(name)`` reads a whole (small) file;
    ``submit(name, starts, stops)`` starts range reads on the background thread and
    returns a Future of their bytes (one request each, at most ``max_requests`` in
    flight, ``If-Match`` the recorded ETag). ``fetched_bytes`` / ``requests`` count
    what was read. ``close()`` stops the thread and closes its loop, on that thread;
    so does collecting the object, or interpreter exit (before modules are torn down),
    so a command ends with nothing of it left running."""

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
        options = _client_options(url, self.timeout_s)
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
        self.etags: dict[str, str | None] = {}
        self.sizes: dict[str, int] = {}
        self.mtimes: dict[str, int] = {}
        self.fetched_bytes = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._gate: _Gate | None = None
        self._reads: dict[asyncio.Task, list[StoreError | None]] = {}  # pending: why failed
        self._stop: weakref.finalize | None = None

    # ------------------------------------------------------------------ the thread

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._gate = _Gate(self.max_requests)  # used on the loop only
                # The thread holds no reference to self, so an unused ObjectFiles is
                # collected (its finalizer stops the thread); at interpreter exit the
                # finalizer runs too, before modules are torn down.
                self._thread = threading.Thread(
                    target=_serve, args=(loop,), name="zephon-fetch", daemon=True
                )
                self._thread.start()
                self._stop = weakref.finalize(self, _stop, loop, self._thread)
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
        """A StoreError for a failed request: written here from the error's kind."""
        from obstore.exceptions import (
            NotFoundError,
            PermissionDeniedError,
            PreconditionError,
            UnauthenticatedError,
        )

        where = self.url.child(name)
        text = str(e)
        retried = re.search(r"after (\d+) retries", text)
        attempts = int(retried.group(1)) + 1 if retried else 1
        variables = CREDENTIAL_VARIABLES[self.url.scheme]
        if isinstance(e, PreconditionError):
            return StoreError(
                f"{where} changed while this job reads it (its ETag is no longer the one "
                "recorded when the store was opened): a store must not be rewritten in "
                "place. Restart the job to read the new version; its fingerprint is checked."
            )
        if isinstance(e, (FileNotFoundError, NotFoundError)) or "NoSuchBucket" in text:
            if "NoSuchBucket" in text or "ContainerNotFound" in text:
                kind = "container" if self.url.scheme == "az" else "bucket"
                return MissingBucket(
                    f"the {kind} of {self.url.shown} does not exist (or is not visible with "
                    f"these credentials): check the URL, and AWS_ENDPOINT_URL for an "
                    "S3-compatible endpoint."
                )
            if name in self.sizes:  # it was there when the store was opened
                return MissingObject(
                    f"{where} does not exist any more: it was deleted after the store was "
                    "opened. Upload the whole store again (manifest.json last) and restart "
                    "the job."
                )
            return MissingObject(f"{where} does not exist.")
        if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or " 403 " in text:
            return StoreError(
                f"access to {where} was denied (403): the credentials found do not allow "
                f"reading it. Grant them read access to the store's prefix, or give others "
                f"(looked for {variables})."
            )
        if "metadata" in text.lower() or "169.254.169.254" in text or "credential" in text.lower():
            return StoreError(
                f"no credentials to read {self.url.shown}: looked for {variables}, and found "
                "none that works."
            )
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)) or "kind: Timeout" in text:
            return _Unanswered(
                f"{doing} {where} took longer than request_timeout_s={self.timeout_s:g} s, "
                f"{self.retries + 1 if not retried else attempts} times (retried with backoff): "
                "the endpoint, or the credential source, does not answer. Check the network "
                "and the endpoint (AWS_ENDPOINT_URL for an S3-compatible one), and the "
                f"credentials: looked for {variables}; or raise zephon.request_timeout_s."
            )
        status = re.search(r"status code: (\d{3})", text)
        if status:
            code = re.search(r"<Code>(\w+)</Code>", text)
            said = f"{status.group(1)} {code.group(1)}" if code else status.group(1)
            return _Unanswered(
                f"{doing} {where} failed {attempts} times (retried with backoff): the "
                f"endpoint answered {said}. The service is failing or throttling this job: "
                "try again later, or read less at once (lower zephon.read_ahead_steps)."
            )
        if "error sending request" in text or "body error" in text or "connection" in text.lower():
            return _Unanswered(
                f"{doing} {where} failed {attempts} times (retried with backoff): the "
                "connection was refused or reset, or an answer was cut short. Check the "
                "network and the endpoint (AWS_ENDPOINT_URL for an S3-compatible one)."
            )
        first = scrub(text.splitlines()[0] if text else type(e).__name__)
        first = re.sub(r"https?://\S+", "<endpoint>", first)
        return StoreError(f"{doing} {where} failed: {first}")

    async def _head(self, name: str) -> dict[str, Any]:
        import obstore

        return await asyncio.wait_for(obstore.head_async(self._store, name), self.limit_s)

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
                obstore.get_async(self._store, name, options=options), self.limit_s
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
            await obstore.put_async(self._store, name, body, chunk_size=UPLOAD_PART)

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

        async def get() -> memoryview:
            result = await obstore.get_async(self._store, name, options=options)
            return memoryview(await result.bytes_async())

        for attempt in range(self.retries + 1):
            await self._gate.acquire(urgent)  # a wait bounded by _gather's early failures
            if read[0] is not None:  # its read failed meanwhile: never sent
                self._gate.release()
                raise asyncio.CancelledError
            try:
                data = await asyncio.wait_for(get(), self.limit_s)
            except Exception as e:
                failed = self._failure(e, name, "reading")
                read[0] = read[0] or failed  # before the slot is freed: marks the read,
                if isinstance(failed, _Unanswered):  # and every read pending, failed
                    for why in self._reads.values():
                        why[0] = why[0] or failed
                raise failed from None
            finally:
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
        endpoint (``_Unanswered``) also fails every other read pending, at once."""
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
        return self._run(self._gather(listed, then, urgent))

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
