"""The operator's Prometheus metrics, in a registry of their own.

`rlft_restarts_total` is defined once in rlft.trainer.telemetry.metrics (the alert rules
and the dashboard import it from there); the operator-only series are defined here.
"""

from __future__ import annotations

import contextlib

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


class OperatorMetrics:
    def __init__(self) -> None:
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

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics, once: a second call (kopf retrying a startup that failed after
        it) returns the bound port, where binding again would fail for good. 0 picks a
        free port; `::` is every address, IPv6 and IPv4 (as the trainers' endpoints bind)."""
        if self.server is None:
            self.server = HTTPServer((host, port), MetricsHandler.factory(self.registry))
            self.server.serve_in_background("rlft-metrics")
        return self.server.server_address[1]

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
