"""One object the training loop talks to: metrics, /status, traces, the HTTP server.

    telemetry = Telemetry.start(job.spec.telemetry)      # serves /metrics, /status
    guard = StepGuard(job.spec.stability, listener=telemetry)
    telemetry.configure(staleness_limit=..., checkpoint_interval_s=...)
    telemetry.set_phase("training")
    with telemetry.tracer.step(step):
        with telemetry.tracer.phase("generate"): ...
    decision = guard.check(record)      # → telemetry.on_decision (metrics, health, events)
    telemetry.record(record)            # → metrics + /status step and policyVersion
    telemetry.checkpoint(step, uri, healthy=guard.healthy_for_checkpoint())
    telemetry.close()

Every decision other than a clean `apply` becomes an event in /status and a log line
(through `log`, default: none), so humans see the same story everywhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from rlft.trainer.config.telemetry import TelemetrySpec
from rlft.trainer.stability.actions import Counters, GuardDecision
from rlft.trainer.telemetry.exporter import MetricsExporter
from rlft.trainer.telemetry.server import TelemetryServer
from rlft.trainer.telemetry.status import POD_UID_ENV, StatusBoard
from rlft.trainer.telemetry.tracing import StepTracer

_EVENT_LEVEL = {
    "apply": "warning",
    "skip": "warning",
    "rollback": "critical",
    "pause": "critical",
    "fail": "critical",
}


class Telemetry:
    """Metrics exporter + status board (+ HTTP server, + tracer) of one trainer."""

    def __init__(
        self,
        exporter: MetricsExporter | None = None,
        board: StatusBoard | None = None,
        tracer: StepTracer | None = None,
        server: TelemetryServer | None = None,
        log: Callable[[str], None] | None = None,
    ):
        self.exporter = exporter or MetricsExporter()
        self.board = board or StatusBoard()
        self.tracer = tracer or StepTracer()
        self.server = server
        self.log = log
        self._last_flagged: tuple[str, ...] = ()

    @classmethod
    def start(
        cls, spec: TelemetrySpec | None = None, log: Callable[[str], None] | None = None
    ) -> Telemetry:
        """Build everything `spec` asks for and start serving."""
        spec = spec or TelemetrySpec()
        exporter = MetricsExporter()
        board = StatusBoard(spec.max_events, os.environ.get(POD_UID_ENV) or None)
        server = TelemetryServer(exporter, board, spec.host, spec.port) if spec.enabled else None
        tracer = StepTracer.from_config(spec.otlp_endpoint, spec.service_name)
        telemetry = cls(exporter, board, tracer, server, log)
        if server is not None and log is not None:
            log(f"rlft: telemetry on {server.url} (/metrics, /status)")
        return telemetry

    @property
    def url(self) -> str | None:
        return self.server.url if self.server else None

    # ------------------------------------------------------------ loop → here

    def configure(self, *, staleness_limit: int, checkpoint_interval_s: float) -> None:
        self.exporter.configure(
            staleness_limit=staleness_limit, checkpoint_interval_s=checkpoint_interval_s
        )

    def set_phase(self, phase: str) -> None:
        self.board.set_phase(phase)

    def record(self, record: Mapping[str, Any]) -> None:
        """One step's record: metrics, and step/policy version in /status."""
        self.exporter.record(record)
        if "step" in record:
            reward = record.get("reward_mean")
            self.board.progress(
                int(record["step"]),
                int(record.get("policy_version", record["step"])),
                float(reward) if isinstance(reward, int | float) else None,
            )

    def checkpoint(self, step: int, uri: str, healthy: bool, when: float | None = None) -> None:
        """A committed checkpoint."""
        when = time.time() if when is None else when
        self.exporter.checkpoint(step, True, when)
        self.board.checkpoint(step, uri, when, healthy)
        message = f"checkpoint at step {step} committed to {uri}"
        self.event("checkpoint", message + ("" if healthy else " (not healthy)"), step=step)

    def restored(self, step: int, uri: str, healthy: bool, when: float) -> None:
        """The checkpoint a resume restored: the last one in /status and in the step
        gauge (they named none until this process's first commit)."""
        self.exporter.restored(step)
        self.board.checkpoint(step, uri, when, healthy)

    def checkpoint_failed(self, step: int, uri: str, error: str) -> None:
        """A checkpoint given up (its retries ran out): RLFTCheckpointFailing's gauge."""
        self.exporter.checkpoint(step, False)
        message = f"checkpoint at step {step} failed and was not committed to {uri}: {error}"
        self.event("checkpoint_failed", message, "warning", step)

    def event(self, kind: str, message: str, level: str = "info", step: int | None = None) -> None:
        self.board.event(kind, message, level, step)
        if self.log is not None and level != "info":
            self.log(f"rlft: {level}: {message}")

    # --------------------------------------------------------- guard → here

    def on_decision(self, decision: GuardDecision, counters: Counters) -> None:
        """StepGuard's listener: metrics, health and counters in /status, events."""
        verdict = decision.verdict
        levels = verdict.levels if verdict else {}
        flagged = tuple(sorted(check for check, level in levels.items() if level))
        self.exporter.decision(
            decision.health, levels, verdict.zscore if verdict else None, decision.action
        )
        self.board.set_health(decision.health)
        self.board.set_counters(rollbacks=counters.rollbacks, skipped_updates=counters.skipped)
        reasons = "; ".join(decision.reasons) or "no reason given"
        if decision.action != "apply":
            self.event(
                decision.action,
                f"step {decision.step}: {decision.action}: {reasons}",
                _EVENT_LEVEL[decision.action],
                decision.step,
            )
        elif flagged != self._last_flagged:
            # One event when the set of flagged checks changes, not one per step of a
            # long warning streak (the list is bounded; it must keep the rare events).
            if flagged:
                self.event("warning", f"step {decision.step}: {reasons}", "warning", decision.step)
            else:
                self.event(
                    "healthy", f"step {decision.step}: health back to ok", step=decision.step
                )
        self._last_flagged = flagged

    def on_rollback(self, counters: Counters) -> None:
        """StepGuard's listener: a rollback restored a checkpoint."""
        self.exporter.rolled_back()
        self.board.set_counters(rollbacks=counters.rollbacks, skipped_updates=counters.skipped)

    def close(self) -> None:
        """Stop the server and flush traces (idempotent)."""
        if self.server is not None:
            self.server.close()
        self.tracer.close()

    def __enter__(self) -> Telemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
