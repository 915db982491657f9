"""A fault-injecting HTTP proxy on loopback, in front of moto's server (conftest.py).

``FaultProxy(upstream)`` forwards every request to ``upstream`` and answers with what it
got, after ``latency_s``; ``inject(path_part, *faults)`` makes the next requests whose
path holds ``path_part`` meet ``faults`` in order, one each, then pass again:

- ``"503"``: a 503 SlowDown answer (S3's throttling), ``"500"``: an InternalError;
- ``"403"``: AccessDenied;
- ``"reset"``: the connection is reset (RST) before any answer;
- ``"truncate"``: the answer's headers promise the whole body, half of it is sent, then
  the connection is closed;
- ``"short"``: a well-formed answer with half the body (its Content-Length says so);
- ``"hang"``: no answer until ``hang_s`` passed.

``seen`` lists (method, path, fault or None) of every request. A real socket server:
the client under test speaks HTTP to it as to any endpoint. The forwarding and the
latency are ``torchtitan_zephon.bench.latency_proxy.LatencyProxy``'s (``zephon bench
remote`` runs that one); this adds the faults.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import deque
from http.server import BaseHTTPRequestHandler

from torchtitan_zephon.bench.latency_proxy import LatencyProxy

_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "403": (403, "AccessDenied", "Access Denied"),
}


class FaultProxy(LatencyProxy):
    def __init__(self, upstream: str, *, latency_s: float = 0.0, hang_s: float = 30.0) -> None:
        self.hang_s = hang_s
        self._faults: list[tuple[str, deque[str]]] = []
        super().__init__(upstream, latency_s=latency_s)

    def inject(self, path_part: str, *faults: str) -> None:
        with self._lock:
            self._faults.append((path_part, deque(faults)))

    def clear(self) -> None:
        """Inject nothing more (the endpoint answers again)."""
        with self._lock:
            self._faults.clear()

    def faults_met(self) -> list[str]:
        return [f for *_, f in self.seen if f]

    # ---------------------------------------------------------------- one request

    def _next_fault(self, path: str) -> str | None:
        with self._lock:
            for part, faults in self._faults:
                if part in path and faults:
                    return faults.popleft()
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        fault = self._next_fault(h.path)
        body = self.receive(h, fault)
        if fault == "reset":
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.connection.close()
            h.close_connection = True
            return
        if fault == "hang":
            time.sleep(self.hang_s)
            h.close_connection = True
            return
        if fault in _ERRORS:
            status, code, message = _ERRORS[fault]
            data = (
                f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{message}</Message></Error>"
            ).encode()
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(data)
            return
        answer, data = self.forward(h, body)
        if fault == "short" and len(data) > 1:
            data = data[: len(data) // 2]
        self.send_head(h, answer, len(data))
        if h.command == "HEAD":
            return
        if fault == "truncate" and len(data) > 1:
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.connection.shutdown(socket.SHUT_RDWR)
            h.close_connection = True
            return
        h.wfile.write(data)
