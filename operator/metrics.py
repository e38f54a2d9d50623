"""The operator's Prometheus metrics, in a registry of their own, and its liveness.

`rlft_restarts_total` is defined once in rlft.trainer.telemetry.metrics (the alert rules
and the dashboard import it from there); the operator-only series are defined here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, MetricsHandler

from rlft.operator.status import PHASES
from rlft.trainer.http_server import HTTPServer
from rlft.trainer.telemetry.metrics import RESTARTS

RECONCILES = "rlft_operator_reconciles_total"
RECONCILE_SECONDS = "rlft_operator_reconcile_duration_seconds"
JOBS = "rlft_operator_jobs"
DECISIONS = "rlft_operator_decisions_total"
CHILDREN = "rlft_operator_children_changes_total"
ROLLBACKS = "rlft_operator_rollbacks_total"


LOOP_STALL_SECONDS = 30.0
"""/livez answers 503 once the operator's event loop has not run for this long."""


class OperatorMetrics:
    def __init__(self) -> None:
        self.beaten = time.monotonic()
        """When the event loop last ran the heartbeat (monotonic)."""
        self.stall_seconds = LOOP_STALL_SECONDS
        self.registry = CollectorRegistry()
        r = self.registry
        name = RESTARTS.name.removesuffix("_total")
        self.restarts = Counter(name, RESTARTS.help, list(RESTARTS.labels), registry=r)
        self.rollbacks = Counter(
            ROLLBACKS.removesuffix("_total"),
            "Rollbacks to the last healthy checkpoint made by the operator.",
            ["rlfinetune"],
            registry=r,
        )
        self.reconciles = Counter(
            RECONCILES.removesuffix("_total"),
            "Reconciles of RLFineTunes, by result.",
            ["result"],
            registry=r,
        )
        self.reconcile_seconds = Histogram(
            RECONCILE_SECONDS,
            "Wall time of one reconcile (API calls included).",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.jobs = Gauge(JOBS, "RLFineTunes by phase.", ["phase"], registry=r)
        self.decisions = Counter(
            DECISIONS.removesuffix("_total"),
            "Decisions taken (one Event each), by reason.",
            ["reason"],
            registry=r,
        )
        self.children = Counter(
            CHILDREN.removesuffix("_total"),
            "Children created and deleted, by kind and action.",
            ["kind", "action"],
            registry=r,
        )
        self._phases: dict[tuple[str, str], str] = {}
        self.server: HTTPServer | None = None

    def set_phase(self, key: tuple[str, str], phase: str | None) -> None:
        if phase is None:
            self._phases.pop(key, None)
        else:
            self._phases[key] = phase
        for known in PHASES:
            self.jobs.labels(phase=known).set(sum(p == known for p in self._phases.values()))

    def forget_job(self, key: tuple[str, str]) -> None:
        """A deleted job's series go with it (one per job ever restarted would stay for
        the operator's lifetime)."""
        self.set_phase(key, None)
        for counter in (self.restarts, self.rollbacks):
            with contextlib.suppress(KeyError):  # never restarted, never rolled back
                counter.remove(f"{key[0]}/{key[1]}")

    async def heartbeat(self, period: float = 1.0) -> None:
        """Beat from the event loop until cancelled. /metrics is served by a thread of its
        own and answered while a handler blocked the loop or it deadlocked, so a probe on
        it never restarted an operator that had stopped reconciling; /livez does."""
        while True:
            self.beaten = time.monotonic()
            await asyncio.sleep(period)

    def stalled_for(self) -> float | None:
        """Seconds since the last beat, when more than `stall_seconds`; else None."""
        since = time.monotonic() - self.beaten
        return since if since > self.stall_seconds else None

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics, once: a second call (kopf retrying a startup that failed after
        it) returns the bound port, where binding again would fail for good. 0 picks a
        free port; `::` is every address, IPv6 and IPv4 (as the trainers' endpoints bind)."""
        if self.server is None:
            self.server = HTTPServer((host, port), _handler(self))
            self.server.serve_in_background("rlft-metrics")
        return self.server.server_address[1]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _handler(metrics: OperatorMetrics) -> type:
    """/livez (the event loop's heartbeat), and /metrics on every other path."""
    base = MetricsHandler.factory(metrics.registry)

    class Handler(base):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:
            if self.path.partition("?")[0] != "/livez":
                return super().do_GET()
            stalled = metrics.stalled_for()
            body = (
                f"the operator's event loop has not run for {stalled:.0f} s\n"
                if stalled is not None
                else "ok\n"
            ).encode()
            self.send_response(503 if stalled is not None else 200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return None

    return Handler
