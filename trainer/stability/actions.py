"""What to do about a step: apply, skip, rollback, pause or fail.

`decide()` is the pure policy (verdict + spec + counters → action). `StepGuard` wraps
the detector and the policy with the counters a run keeps, and is what the training
loop uses. How the loop must call it, once per optimizer step:

    guard = StepGuard(spec.stability, listener=telemetry)   # telemetry: optional
    ...
    loss.backward()                                          # all micro-batches
    grad_norm = clip_grad_norm_(params, max_norm)            # norm BEFORE clipping
    record = {"step": step, "grad_norm": grad_norm.item(), "loss": ..., "entropy": ...,
              "reward_mean": ..., "kl": ..., "ratio_max": ..., ...}   # everything known
    decision = guard.check(record)                           # BEFORE optimizer.step()
    match decision.action:
        case "apply":    optimizer.step()
        case "skip":     optimizer.zero_grad(set_to_none=True)   # update never applied;
                         # the step still counts (data consumed, step number advances)
        case "rollback": restore the newest checkpoint whose manifest says healthy and whose
                         step < decision.restore_before_step; then
                         guard.restore_detector(checkpoint["detector"]); if
                         decision.resume_data_after_step is set, move the data cursor past
                         that step (skip the window that led to the collapse)
        # rollback, pause and fail never apply the update either.
        case "pause":    write a checkpoint (healthy=False), set /status phase "paused", stop
                         with ExitCode.OK and wait for the operator / user
        case "fail":     stop with ExitCode.COLLAPSED
    lr = scheduled_lr(step) * guard.lr_multiplier            # every step, rollbacks lower it
    ... at a checkpoint: manifest["healthy"] = guard.healthy_for_checkpoint();
                         state["guard"] = guard.state_dict()

`record` is the same dict later written to metrics.jsonl and given to
`exporter.record()`; values computed after optimizer.step() (timings) may be added
later, the detector only needs what exists before the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rlft.trainer.config.stability import StabilitySpec
from rlft.trainer.stability.detector import CRITICAL, OK, WARNING, Detector, Verdict

Action = Literal["apply", "skip", "rollback", "pause", "fail"]
ACTIONS: tuple[str, ...] = Action.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Counters:
    """What the guard has done so far in this run."""

    skipped: int = 0
    rollbacks: int = 0


@dataclass
class GuardDecision:
    """The guard's answer for one step."""

    step: int
    action: Action
    health: str
    """`ok`, `warning` or `collapsed`: what /status reports."""
    level: int
    """Worst check level (0 ok, 1 warning, 2 critical)."""
    reasons: list[str] = field(default_factory=list)
    verdict: Verdict | None = None
    lr_multiplier: float = 1.0
    """Factor on the scheduled learning rate from now on (changes only at a rollback)."""
    restore_before_step: int | None = None
    """Rollback: restore the newest healthy checkpoint older than this step (the first
    step of the trouble that led to the collapse)."""
    resume_data_after_step: int | None = None
    """Rollback: continue the data stream after this step (skip the bad window)."""


def decide(verdict: Verdict, spec: StabilitySpec, counters: Counters) -> tuple[Action, str | None]:
    """The action for a verdict, and a line explaining a non-obvious choice."""
    if verdict.collapsed:
        if spec.on_collapse == "rollback":
            if counters.rollbacks < spec.max_rollbacks:
                return "rollback", None
            action: Action = "pause" if spec.after_max_rollbacks == "suspend" else "fail"
            return action, f"{counters.rollbacks} rollbacks made (maxRollbacks reached)"
        if spec.on_collapse == "suspend":
            return "pause", None
        if spec.on_collapse == "fail":
            return "fail", None
        # onCollapse: alert still refuses to apply a non-finite or spiking update.
    if verdict.levels.get("non_finite", OK) >= CRITICAL:
        # Never applied, whatever onSpike says: one NaN makes every weight and both
        # AdamW moments NaN, and nothing after it can train.
        return "skip", None
    if verdict.skip_update and spec.on_spike == "skip":
        return "skip", None
    return "apply", None


class DecisionListener(Protocol):
    def on_decision(self, decision: GuardDecision, counters: Counters) -> None: ...

    def on_rollback(self, counters: Counters) -> None: ...


class StepGuard:
    """The detector, the action policy and the counters of one run."""

    def __init__(self, spec: StabilitySpec | None = None, listener: DecisionListener | None = None):
        self.spec = spec or StabilitySpec()
        self.detector = Detector(self.spec.detector)
        self.listener = listener
        self.counters = Counters()
        self.trouble_since: int | None = None
        """First flagged step of the current trouble (None when the run looks clean)."""
        self._clean_steps = 0

    @property
    def lr_multiplier(self) -> float:
        """Product of the LR scales of all rollbacks so far."""
        return self.spec.rollback_lr_scale**self.counters.rollbacks

    def check(self, record: dict[str, Any]) -> GuardDecision:
        """Judge one step (call before optimizer.step()) and decide what to do."""
        verdict = self.detector.observe(record)
        if verdict.level >= WARNING:
            self._clean_steps = 0
            if self.trouble_since is None:
                self.trouble_since = verdict.step
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.spec.detector.sustained.window:
                self.trouble_since = None
        action, note = decide(verdict, self.spec, self.counters)
        reasons = list(verdict.reasons) + ([note] if note else [])
        decision = GuardDecision(
            step=verdict.step,
            action=action,
            health=verdict.health,
            level=verdict.level,
            reasons=reasons,
            verdict=verdict,
        )
        decision.lr_multiplier = self.lr_multiplier
        if action == "skip":
            self.counters = Counters(self.counters.skipped + 1, self.counters.rollbacks)
        elif action == "rollback":
            # Counted once it happened (`rolled_back`): a rollback that finds no
            # checkpoint ends the run, and was reported as made. Its learning-rate scale
            # is the one the run goes on with if it does.
            decision.lr_multiplier *= self.spec.rollback_lr_scale
            decision.restore_before_step = self.trouble_since or verdict.step
            if self.spec.skip_data_window:
                decision.resume_data_after_step = verdict.step
        if self.listener is not None:
            self.listener.on_decision(decision, self.counters)
        return decision

    def rolled_back(self) -> None:
        """The rollback a decision asked for restored a checkpoint."""
        self.counters = Counters(self.counters.skipped, self.counters.rollbacks + 1)
        if self.listener is not None:
            self.listener.on_rollback(self.counters)

    def healthy_for_checkpoint(self) -> bool:
        """Whether a checkpoint taken now may be tagged healthy (no recent trouble)."""
        return self.trouble_since is None

    def restore_detector(self, detector_state: dict[str, Any]) -> None:
        """After a rollback: the detector as it was at the restored checkpoint; the
        counters (skips, rollbacks, LR multiplier) keep what happened since."""
        self.detector.load_state_dict(detector_state)
        self.trouble_since = None
        self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state for checkpoints."""
        return {
            "detector": self.detector.state_dict(),
            "skipped": self.counters.skipped,
            "rollbacks": self.counters.rollbacks,
            "trouble_since": self.trouble_since,
            "clean_steps": self._clean_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume (a restarted process): everything, counters included."""
        self.detector.load_state_dict(state["detector"])
        self.counters = Counters(int(state["skipped"]), int(state["rollbacks"]))
        self.trouble_since = state.get("trouble_since")
        self._clean_steps = int(state.get("clean_steps", 0))


__all__ = ["ACTIONS", "OK", "Counters", "GuardDecision", "StepGuard", "decide"]
