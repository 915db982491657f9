"""An HTTP proxy on loopback that adds a fixed latency to every request.

Role: ``LatencyProxy(upstream, latency_s=...)`` forwards every request to ``upstream``
(an S3 API server: moto's, in ``zephon bench remote`` and the tests) and answers with
what it got, ``latency_s`` after the request arrived: what a store in a bucket across
a network costs per request, put in front of a server on the same machine. ``seen``
lists (method, path, fault) of every request (fault: always None here; the tests'
fault-injecting proxy, ``tests/remote/faults.py``, builds on this one).
``python -m torchtitan_zephon.bench.latency_proxy UPSTREAM LATENCY_MS`` runs one in a
process of its own (so its threads never share a GIL with the loader measured) and
prints its endpoint on the first line of stdout; it stops when stdin closes.

Invariant: an answer passed on has the upstream's status, headers (hop-by-hop ones
excepted) and body, byte for byte; every request waits ``latency_s`` once, requests
in flight wait concurrently (one thread each), as on a real network.
"""

from __future__ import annotations

import http.client
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Headers the proxy sets itself (or that belong to one connection only).
_HOP = ("transfer-encoding", "connection", "content-length", "server", "date")


class LatencyProxy:
    """Forwards to ``upstream`` after ``latency_s`` per request; see the module docstring."""

    def __init__(self, upstream: str, *, latency_s: float = 0.0) -> None:
        self.upstream = urlsplit(upstream)
        self.latency_s = latency_s
        self.seen: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---------------------------------------------------------------- one request

    def receive(self, h: BaseHTTPRequestHandler, fault: str | None = None) -> bytes | None:
        """Read the request's body, record the request, wait ``latency_s``."""
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        with self._lock:
            self.seen.append((h.command, h.path, fault))
        if self.latency_s:
            time.sleep(self.latency_s)
        return body

    def forward(
        self, h: BaseHTTPRequestHandler, body: bytes | None
    ) -> tuple[http.client.HTTPResponse, bytes]:
        """The upstream's answer to the request, and its whole body."""
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            conn.request(h.command, h.path, body=body, headers=dict(h.headers.items()))
            answer = conn.getresponse()
            data = answer.read()
        finally:
            conn.close()
        return answer, data

    def send_head(
        self, h: BaseHTTPRequestHandler, answer: http.client.HTTPResponse, length: int
    ) -> None:
        """The answer's status and headers, with ``Content-Length`` ``length`` (a HEAD:
        the upstream's own)."""
        h.send_response(answer.status, answer.reason)
        for k, v in answer.getheaders():
            if k.lower() not in _HOP:
                h.send_header(k, v)
        declared = answer.getheader("Content-Length") if h.command == "HEAD" else None
        h.send_header("Content-Length", declared or str(length))
        h.end_headers()

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = self.receive(h)
        answer, data = self.forward(h, body)
        self.send_head(h, answer, len(data))
        if h.command != "HEAD":
            h.wfile.write(data)


def main(argv: list[str]) -> int:
    """``UPSTREAM LATENCY_MS``: serve until stdin closes; the endpoint on stdout."""
    upstream, latency_ms = argv[0], float(argv[1])
    proxy = LatencyProxy(upstream, latency_s=latency_ms / 1000)
    print(proxy.endpoint, flush=True)
    sys.stdin.read()  # the parent closes our stdin (or dies): stop
    proxy.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
