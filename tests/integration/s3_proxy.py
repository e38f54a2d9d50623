"""A pass-through HTTP proxy in front of SeaweedFS's S3 API that can hold requests: the
fault tests point a job's object store at it and stall its checkpoint uploads, so a
trainer can be killed while one is in flight.

Requests go to the server unchanged (the Host header too, so S3 signatures still
verify), one connection per request. `hold(fragment)` makes every upload (PUT, or a
multipart POST) whose path contains `fragment` wait until `release()`, which answers the
held ones with 503 (the client's retry or its death decides what happens next);
`refuse(fragment)` answers such uploads with 503 at once, until `release()` (or, with
`times`, that many of them). Reads
pass: retention's scan after a commit reads the manifests of committed steps, and holding
one of those is not an upload in flight; `refuse(fragment, reads=True)` refuses every
request (a store that is down). `deny(fragment)` answers reads of matching keys (or the
`methods` given) with the 403 AccessDenied an access policy gives (S3's own error body,
so botocore parses it).
"""

from __future__ import annotations

import http.client
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

WRITES = {"PUT", "POST"}
READS = {"GET", "HEAD"}
DENIED = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    "<Message>Access Denied</Message><RequestId>test-proxy</RequestId></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection"}


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # A client killed mid-request (the fault tests' point) resets its connection.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class S3Proxy:
    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.held_fragment: str | None = None
        self.refusals_left: int | None = None
        """How many more requests `refuse(times=…)` refuses (None: all)."""
        self.methods = WRITES
        """The requests `hold` and `refuse` act on."""
        self.held = 0
        """Requests waiting now."""
        self.held_paths: list[str] = []
        """Every path held so far."""
        self.denied_fragment: str | None = None
        self.denied_methods = READS
        self.denied = 0
        """Reads answered 403 so far."""
        self._released = threading.Event()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return None

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    parts = []
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(parts)
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _deny(self) -> None:
                with proxy._lock:
                    proxy.denied += 1
                data = DENIED.encode() if self.command != "HEAD" else b""
                self.send_response(403, "Forbidden")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _held(self) -> bool:
                with proxy._lock:
                    fragment = proxy.held_fragment
                    if fragment is None or fragment not in self.path:
                        return False
                    if self.command not in proxy.methods or proxy.refusals_left == 0:
                        return False  # not one it acts on, or refused as many as asked
                    if proxy.refusals_left is not None:
                        proxy.refusals_left -= 1
                    proxy.held += 1
                    proxy.held_paths.append(self.path)
                return True

            def _forward(self) -> None:
                body = self._body()
                with proxy._lock:  # the fragment and its methods as one setting
                    denied, methods = proxy.denied_fragment, proxy.denied_methods
                if denied is not None and denied in self.path and self.command in methods:
                    self._deny()
                    return
                if self._held():
                    proxy._released.wait()
                    with proxy._lock:
                        proxy.held -= 1
                    self.send_response(503, "held by the test's proxy")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    connection.request(self.command, self.path, body, headers)
                    answer = connection.getresponse()
                    data = answer.read()
                finally:
                    connection.close()
                self.send_response(answer.status, answer.reason)
                for key, value in answer.getheaders():
                    if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def hold(self, fragment: str) -> None:
        self._released.clear()
        with self._lock:
            self.refusals_left = None
            self.held_fragment, self.methods = fragment, WRITES

    def refuse(self, fragment: str, reads: bool = False, times: int | None = None) -> None:
        self._released.set()
        with self._lock:
            self.refusals_left = times
            self.held_fragment = fragment
            self.methods = {"GET", "HEAD", "PUT", "POST", "DELETE"} if reads else WRITES

    def deny(self, fragment: str, methods: set[str] = READS) -> None:
        with self._lock:
            self.denied_fragment, self.denied_methods = fragment, methods

    def release(self) -> None:
        """Every request passes again (held ones are answered 503); the counts stay."""
        with self._lock:
            self.held_fragment = self.denied_fragment = None
            self.refusals_left, self.methods, self.denied_methods = None, WRITES, READS
        self._released.set()

    def stop(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)
