"""A trainer pod's liveness endpoint, and the watch that declares its rank stalled.

Every rank of a job with `spec.trainer.stallTimeoutSeconds` > 0 runs a watch thread
(which writes the rank's `stalled` verdict the moment it stalls, `liveness.py`). Local
rank 0 of each pod also serves, on `$RLFT_LIVENESS_PORT` (set by the operator):

- `GET /livez` for the pod's liveness probe: 200 unless the rank is stalled, 503 once it
  is (also 200 before its loop begins: a worker restarted in place is starting again);
- `GET /started` for its startup probe: 503 until the rank's loop has begun.

One agent per pod starts `--nproc-per-node` workers, so the probes ask local rank 0: in
lockstep training a rank that hangs stops the others at their next collective, local
rank 0 among them.

It binds the pod's IP (`$RLFT_POD_IP`), where a kubelet's probes go by default; on the
test cluster pods share one network namespace, so each must bind its own address.
Standard library only, on daemon threads: it answers while the main thread is blocked
in a collective (those release the GIL).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

from rlft.trainer.addresses import http_url
from rlft.trainer.http_server import HTTPServer
from rlft.trainer.telemetry.liveness import PATH, PORT_ENV, STARTED_PATH, Liveness, install


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in (PATH, STARTED_PATH):
            self._reply(404, {"error": f"no route GET {self.path}; try {PATH}"})
            return
        liveness = self.server.liveness
        state = liveness.check()
        ok = state.alive and (state.started or path == PATH)
        self._reply(200 if ok else 503, state.document(liveness.stall_timeout_s))

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """A probe every few seconds would flood the trainer's log; stay quiet."""


class _Server(HTTPServer):
    liveness: Liveness


class LivenessServer:
    """Serves `GET /livez` for `liveness` until `close()`; port 0 picks a free one."""

    def __init__(self, liveness: Liveness, host: str = "127.0.0.1", port: int = 0):
        self._server = _Server((host, port), _Handler)
        self._server.liveness = liveness
        self._thread = self._server.serve_in_background("rlft-liveness", 0.2)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return http_url(host, port, PATH)

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


class Watch:
    """Checks `liveness` every `interval_s` (declaring a stall without waiting for a
    probe to ask, so the verdict is there before the kubelet kills the container)."""

    def __init__(self, liveness: Liveness, interval_s: float):
        self.liveness = liveness
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(interval_s,), name="rlft-liveness-watch", daemon=True
        )
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.liveness.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class Running:
    """What `start` started: the watch, and the endpoint on local rank 0."""

    def __init__(self, watch: Watch | None, server: LivenessServer | None):
        self.watch, self.server = watch, server

    def close(self) -> None:
        for part in (self.server, self.watch):
            if part is not None:
                part.close()


def watch_interval(stall_timeout_s: float) -> float:
    """How often the watch looks: a twentieth of the timeout, between 0.1 and 1 s."""
    return min(1.0, max(0.1, stall_timeout_s / 20))


def start(
    stall_timeout_s: float, rank: int, environ: dict[str, str] | None = None, bind_s: float = 10
) -> Running:
    """This rank's liveness, installed for the process: a watch when the timeout is on,
    and the endpoint when this is local rank 0 of a pod the operator probes. Raises
    OSError when the endpoint's port stays taken for `bind_s` (the probe would fail)."""
    environ = dict(os.environ) if environ is None else environ
    liveness = install(Liveness(stall_timeout_s, rank))
    if stall_timeout_s <= 0:
        return Running(None, None)
    server = None
    port = environ.get(PORT_ENV)
    if port and environ.get("LOCAL_RANK", "0") == "0":
        server = _bind(liveness, pod_address(environ), int(port), bind_s)
    return Running(Watch(liveness, watch_interval(stall_timeout_s)), server)


POD_IP_ENV = "RLFT_POD_IP"
"""Set by the operator in every pod (the downward API's status.podIP)."""


def pod_address(environ: dict[str, str] | None = None) -> str:
    """The address others reach this process at: its pod's IP (loopback in a pod is the
    pod's own), loopback outside Kubernetes."""
    return (os.environ if environ is None else environ).get(POD_IP_ENV) or "127.0.0.1"


def _bind(liveness: Liveness, host: str, port: int, within_s: float) -> LivenessServer:
    # A worker restarted in place (an elastic membership change) may start while its
    # predecessor's socket is still closing: try again for a few seconds.
    deadline = time.monotonic() + within_s
    while True:
        try:
            return LivenessServer(liveness, host, port)
        except OSError as error:
            if time.monotonic() >= deadline:
                raise OSError(
                    f"cannot serve the liveness endpoint on {host}:{port} ({error})"
                ) from None
            print(f"rlft: liveness port {host}:{port} busy ({error}); retrying", file=sys.stderr)
            time.sleep(0.5)
