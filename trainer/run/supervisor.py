"""The stability guard and telemetry of a running job, around every optimizer step.

Rank 0 judges each update with the collapse detector (`StepGuard`) after the gradient is
clipped and before the optimizer step, serves /metrics and /status, and broadcasts the
decision so every rank does the same: apply, skip (zero the update), roll back (restore
the newest healthy checkpoint before the trouble, keep the data stream past the bad
window, scale the learning rate), pause (checkpoint, exit 0) or fail (exit 3).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rlft.trainer.distributed import Dist
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.stability.actions import GuardDecision, StepGuard
from rlft.trainer.telemetry.hub import Telemetry


class RunEnded(Exception):
    """The guard ended the run: `code` is the exit code to report."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Supervisor:
    def __init__(self, job, dist: Dist, log):
        spec = job.spec
        self.dist = dist
        self.log = log
        self.telemetry = Telemetry.start(spec.telemetry, log=log) if dist.is_main else None
        if self.telemetry is not None:
            self.telemetry.configure(
                staleness_limit=spec.rollout.max_staleness,
                checkpoint_interval_s=spec.checkpoint.interval_minutes * 60,
            )
        self.guard = StepGuard(spec.stability, listener=self.telemetry) if dist.is_main else None
        self.lr_multiplier = 1.0

    def judge(self, record: dict[str, Any]) -> GuardDecision:
        """The guard's decision for this update (rank 0's, on every rank)."""
        decision = self.guard.check(record) if self.guard is not None else None
        decision = self.dist.broadcast(decision)
        self.lr_multiplier = decision.lr_multiplier
        return decision

    def rolled_back(self) -> None:
        """The decided rollback restored a checkpoint (every rank): counted now, and the
        learning-rate multiplier is the guard's with it."""
        if self.guard is not None:
            self.guard.rolled_back()
        self._share_lr_multiplier()

    def _share_lr_multiplier(self) -> None:
        """Rank 0's guard's learning-rate multiplier, on every rank (collective)."""
        self.lr_multiplier = self.dist.broadcast(
            self.guard.lr_multiplier if self.guard is not None else None
        )

    def healthy(self) -> bool:
        """Whether a checkpoint now may be tagged healthy (rank 0 decides the manifest)."""
        return self.guard.healthy_for_checkpoint() if self.guard is not None else True

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict() if self.guard is not None else {}

    def load_state_dict(self, state: dict[str, Any], rollback: bool = False) -> None:
        """On resume: everything; after a rollback: the detector only (counters keep)."""
        if self.guard is not None and state:
            if rollback:
                self.guard.restore_detector(state["detector"])
            else:
                self.guard.load_state_dict(state)
                if self.telemetry is not None:  # /status said 0 until the next decision
                    counters = self.guard.counters
                    self.telemetry.board.set_counters(
                        rollbacks=counters.rollbacks, skipped_updates=counters.skipped
                    )
        if not rollback:  # a rollback's multiplier is set once it is counted (rolled_back)
            self._share_lr_multiplier()

    def record(self, record: dict[str, Any]) -> None:
        if self.telemetry is not None:
            self.telemetry.record(record)

    def watch_engines(self, client) -> None:
        """Export the rollout client's live instances at each scrape (rank 0)."""
        if self.telemetry is not None:
            self.telemetry.exporter.watch_engines(
                lambda: (len(client.live()), len(client.instances))
            )

    def checkpointed(self, step: int, uri: str, healthy: bool) -> None:
        if self.telemetry is not None:
            self.telemetry.checkpoint(step, uri, healthy)

    def resumed_from(self, step: int, uri: str, healthy: bool, created_at: str) -> None:
        """The checkpoint a resume restored: /status and the step gauge name it as the
        last one (they named none until this process's first commit)."""
        if self.telemetry is not None:
            when = datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp()
            self.telemetry.restored(step, uri, healthy, when)

    def checkpoint_failed(self, step: int, uri: str, error: str) -> None:
        if self.telemetry is not None:
            self.telemetry.checkpoint_failed(step, uri, error)

    def checkpoint_retry(self, message: str, step: int | None, count: int = 1) -> None:
        if self.telemetry is not None:
            self.telemetry.exporter.checkpoint_retry(count)
            text = message if count == 1 else f"{message} ({count} retries)"
            self.telemetry.event("checkpoint_retry", text, "warning", step)

    def event(self, kind: str, message: str, level: str = "info", step: int | None = None):
        if self.telemetry is not None:
            self.telemetry.event(kind, message, level, step)

    @staticmethod
    def ended(decision: GuardDecision, step: int) -> RunEnded | None:
        """The exception that ends the run after this step's decision, if any."""
        reasons = "; ".join(decision.reasons)
        if decision.action == "fail":
            return RunEnded(f"collapse at step {step} ({reasons}); failing", ExitCode.COLLAPSED)
        if decision.action == "pause":
            return RunEnded(
                f"collapse at step {step} ({reasons}); paused (a resume goes on from the "
                "newest healthy checkpoint)",
                ExitCode.OK,
            )
        return None

    def set_phase(self, phase: str) -> None:
        if self.telemetry is not None:
            self.telemetry.set_phase(phase)

    def begin(self, main: bool, step: int, policy_version: int) -> None:
        """A phase's loop begins: the main phase at the step and version it resumed from
        (or 0), which /status reports from now on (the operator mirrors it only then)."""
        if self.telemetry is None:
            return
        if main:
            self.telemetry.board.progress(step, policy_version)
            # The gauges too: a resumed run stuck in its first step showed step 0, which
            # RLFTNoProgress reads as a warm start, and dashboards a drop to 0.
            self.telemetry.exporter.record({"step": step, "policy_version": policy_version})
            self.telemetry.exporter.main_phase_began()
        self.telemetry.set_phase("training" if main else "warm_start")

    def close(self) -> None:
        if self.telemetry is not None:
            self.telemetry.close()
