"""The trainer's HTTP endpoint: `/metrics`, `/status`, `/healthz`.

Standard library `http.server` in a daemon thread: nothing to install on the operator
side, no event loop to share with the training loop. Binds 127.0.0.1 by default; port 0
picks a free port (read it back from `.port`). `close()` stops it and frees the port.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rlft.trainer.addresses import http_url
from rlft.trainer.http_server import HTTPServer
from rlft.trainer.telemetry.exporter import MetricsExporter
from rlft.trainer.telemetry.status import StatusBoard


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._reply(200, CONTENT_TYPE_LATEST, self.server.metrics())
        elif path == "/status":
            body = json.dumps(self.server.status()).encode()
            self._reply(200, "application/json", body)
        elif path == "/healthz":
            self._reply(200, "text/plain; charset=utf-8", b"ok\n")
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics, /status\n")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes every few seconds would flood the trainer's log; stay quiet."""


class _Server(HTTPServer):
    metrics: Callable[[], bytes]
    status: Callable[[], dict]


class TelemetryServeError(RuntimeError):
    """The telemetry endpoint cannot listen where the job says (a port in use, say)."""


class TelemetryServer:
    """Serves an exporter's registry and a status board until `close()`."""

    def __init__(
        self,
        exporter: MetricsExporter,
        board: StatusBoard,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        try:
            self._server = _Server((host, port), _Handler)
        except OSError as error:
            raise TelemetryServeError(
                f"spec.telemetry: cannot serve /metrics and /status on {host}:{port} "
                f"({error.strerror or error}): choose another port (0: a free one) or "
                "host, or set enabled: false"
            ) from None
        self._server.metrics = exporter.exposition
        self._server.status = board.snapshot
        self._thread = self._server.serve_in_background("rlft-telemetry", 0.1)

    @property
    def host(self) -> str:
        return self._server.server_address[0]

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()

    def __enter__(self) -> TelemetryServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
