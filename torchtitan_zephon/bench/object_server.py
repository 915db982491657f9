"""A read-only S3 API on loopback that serves stores from objects it computes or from
local folders (``zephon bench corpus``).

Role: ``ObjectServer({prefix: source})`` answers what a store's reader asks of a bucket
(``store.location``, through obstore): HEAD, GET of a whole object or of a byte range
(``Range: bytes=a-b``, answered 206 with ``Content-Range``), ``If-Match`` against the
object's ETag (412 when it differs), ``NoSuchKey`` (404) for a name the source does not
hold, and listings. A source is anything with ``names()``, ``size(name) -> int | None`` and ``read(name,
start, stop) -> bytes``: a ``bench.virtual_corpus.VirtualCorpus`` (nothing stored) or a
``Folder`` (a store on local disk). Every request is counted by method and by where it
went (the store's prefix and the first folder of the name: ``tokens/`` for every shard,
``packing/`` for the packing indexes): what S3 limits per key prefix.

Invariant: a GET returns exactly ``source.read(name, a, b + 1)`` for ``Range: bytes=a-b``
(the whole object without one), with the object's size in ``Content-Range``; the ETag of
an object is fixed for the server's life, so a reader that pins it never sees a change.
A listing (ListObjectsV2: what a reader asks to say why a prefix holds no store)
names every object under the prefix. Anything else (PUT, DELETE) is refused with 501:
the server is read-only.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections import Counter
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

BUCKET = "zephon-corpus"
_MODIFIED = formatdate(1_700_000_000, usegmt=True)
_LISTED = "2023-11-14T22:13:20.000Z"  # the same instant, as a listing writes it


class Folder:
    """The files of a local folder as objects (``name``: a path relative to it)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def names(self) -> list[str]:
        return sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()
        )

    def size(self, name: str) -> int | None:
        path = self.root / name
        return path.stat().st_size if path.is_file() and ".." not in name else None

    def read(self, name: str, start: int, stop: int) -> bytes:
        with open(self.root / name, "rb") as f:
            f.seek(start)
            return f.read(max(0, stop - start))


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A reader that hung up mid-answer (a cancelled read-ahead) is no error here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class ObjectServer:
    """Serves ``sources`` (prefix -> source) under ``s3://BUCKET/prefix/``; see the module
    docstring. ``endpoint`` is its URL; ``counts`` its requests, (method, where) -> n;
    ``bytes_sent`` the bodies' bytes."""

    def __init__(self, sources: dict[str, Any]) -> None:
        self.sources = dict(sources)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.bytes_sent = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                server._answer(self, body=False)

            def do_GET(self) -> None:
                server._answer(self, body=True)

            def _refuse(self) -> None:
                server._send(self, 501, b"read-only", {})

            do_PUT = do_POST = do_DELETE = _refuse

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.bytes_sent = 0

    # ---------------------------------------------------------------- one request

    def _find(self, key: str) -> tuple[str, Any, str] | None:
        for prefix, source in self.sources.items():
            if key.startswith(prefix + "/"):
                return prefix, source, key[len(prefix) + 1 :]
        return None

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        parts = urlsplit(h.path)
        bucket, _, key = unquote(parts.path).lstrip("/").partition("/")
        query = parse_qs(parts.query)
        if bucket == BUCKET and not key and query.get("list-type") == ["2"]:
            self._list(h, query)
            return
        found = self._find(key) if bucket == BUCKET and not parts.query else None
        size = found[1].size(found[2]) if found else None
        where = f"{found[0]}/{found[2].split('/')[0]}" if found else "?"
        with self._lock:
            self.counts[(h.command, where)] += 1
        if found is None or size is None:
            error = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code>"
            error += b"<Message>The specified key does not exist.</Message></Error>"
            self._send(h, 404, error if body else b"", {"Content-Type": "application/xml"})
            return
        prefix, source, name = found
        etag = self._etag(f"{prefix}/{name}", size)
        headers = {"ETag": etag, "Last-Modified": _MODIFIED, "Accept-Ranges": "bytes"}
        match = h.headers.get("If-Match")
        if match is not None and match.strip() != etag:
            self._send(h, 412, b"", headers)
            return
        start, stop, status = 0, size, 200
        spec = h.headers.get("Range")
        if spec:
            first, _, last = spec.removeprefix("bytes=").partition("-")
            start = int(first)
            stop = min(size, int(last) + 1) if last else size
            if start >= size:
                headers["Content-Range"] = f"bytes */{size}"
                self._send(h, 416, b"", headers)
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        if not body:
            headers["Content-Length"] = str(size)
            self._send(h, 200, b"", headers, length=size)
            return
        data = source.read(name, start, stop)
        with self._lock:
            self.bytes_sent += len(data)
        self._send(h, status, data, headers)

    def _list(self, h: BaseHTTPRequestHandler, query: dict[str, list[str]]) -> None:
        """ListObjectsV2: the keys under ``prefix``, ``max-keys`` at a time."""
        with self._lock:
            self.counts[("LIST", query.get("prefix", [""])[0])] += 1
        prefix = query.get("prefix", [""])[0]
        limit = int(query.get("max-keys", ["1000"])[0])
        after = int(query.get("continuation-token", ["0"])[0])
        keys = sorted(
            (f"{p}/{name}", source)
            for p, source in self.sources.items()
            for name in source.names()
            if f"{p}/{name}".startswith(prefix)
        )
        page = keys[after : after + limit]
        xml = [f"<Name>{BUCKET}</Name><Prefix>{escape(prefix)}</Prefix>",
               f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{limit}</MaxKeys>",
               f"<IsTruncated>{'true' if after + limit < len(keys) else 'false'}</IsTruncated>"]  # fmt: skip
        if after + limit < len(keys):
            xml.append(f"<NextContinuationToken>{after + limit}</NextContinuationToken>")
        for key, source in page:
            size = source.size(key.partition("/")[2])
            xml.append(
                f"<Contents><Key>{escape(key)}</Key><LastModified>{_LISTED}</LastModified>"
                f"<ETag>&quot;{self._etag(key, size)[1:-1]}&quot;</ETag><Size>{size}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
        data = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            + "".join(xml)
            + "</ListBucketResult>"
        ).encode()
        self._send(h, 200, data, {"Content-Type": "application/xml"})

    @staticmethod
    def _etag(key: str, size: int | None) -> str:
        return '"' + hashlib.md5(f"{key}:{size}".encode()).hexdigest() + '"'

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler,
        status: int,
        data: bytes,
        headers: dict[str, str],
        length: int | None = None,
    ) -> None:
        h.send_response(status)
        for k, v in headers.items():
            if k != "Content-Length":
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(data) if length is None else length))
        h.end_headers()
        if data:
            h.wfile.write(data)
