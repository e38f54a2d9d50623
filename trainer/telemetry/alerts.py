"""Prometheus alerting rules, written from the metric definitions.

Every expression is built from `metrics.py` objects, never from a typed name, so a
renamed metric renames its alerts. `python -m rlft.trainer.telemetry.generate` writes
them to observability/rules/rlft-alerts.yaml; `promtool test rules` checks their
behaviour on hand-written series (observability/tests/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlft.trainer.stability.detector import TREND_CHECKS
from rlft.trainer.telemetry import metrics as M

GROUP = "rlft"


@dataclass(frozen=True)
class Alert:
    """One alerting rule."""

    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str

    def to_rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def _alarms(check: str) -> str:
    return f'{M.ALARMS.name}{{check="{check}"}}'


# A trend check at critical level is the detector's collapse; counted, it outlives the
# health gauge, which a rollback sets back at the next step (before a scrape, often).
_COLLAPSES = f'{M.ALARMS.name}{{check=~"{"|".join(TREND_CHECKS)}",level="critical"}}'
_RESTARTS = M.RESTARTS.name


def _per_job(restarts: str) -> str:
    return f"sum by (rlfinetune) (max by (rlfinetune, instance) ({restarts}))"


ALERTS: tuple[Alert, ...] = (
    Alert(
        "RLFTGradientSpike",
        f"sum without (check, level) (increase({_alarms('grad_norm_spike')}[10m])) > 0",
        "0m",
        "warning",
        "Gradient-norm spike in {{ $labels.instance }}",
        "The collapse detector flagged a gradient-norm spike in the last 10 minutes "
        "(critical spikes are skipped before optimizer.step()). See /status events.",
    ),
    Alert(
        "RLFTNonFiniteValues",
        f"sum without (check, level) (increase({_alarms('non_finite')}[10m])) > 0",
        "0m",
        "critical",
        "NaN/Inf in training metrics of {{ $labels.instance }}",
        "A step produced NaN or Inf (loss, gradient norm or another metric); its update "
        "was not applied.",
    ),
    Alert(
        "RLFTCollapsed",
        f"max_over_time({M.HEALTH.name}[5m]) >= {M.HEALTH_LEVELS['collapsed']} "
        f"or sum without (check, level) (increase({_COLLAPSES}[5m])) > 0",
        "0m",
        "critical",
        "Training run {{ $labels.instance }} collapsed",
        "The collapse detector declared collapse (sustained spikes, entropy or reward "
        "collapse, KL or importance-ratio blow-up, or MoE expert-load collapse); "
        "spec.stability.onCollapse decides what happens next.",
    ),
    Alert(
        "RLFTRolledBack",
        f"increase({M.ROLLBACKS.name}[30m]) > 0",
        "0m",
        "warning",
        "Training run {{ $labels.instance }} rolled back",
        "The trainer restored its last healthy checkpoint after a collapse.",
    ),
    Alert(
        "RLFTNoProgress",
        # Past the warm start: a resumed run at its step, or a fresh one whose main
        # phase began 15 minutes ago and is still at step 0 (its first step stuck).
        f"changes({M.TRAIN_STEP.name}[15m]) == 0 and ({M.TRAIN_STEP.name} > 0 "
        f"or (time() - {M.MAIN_PHASE_START.name} > 900 and {M.MAIN_PHASE_START.name} > 0))",
        "5m",
        "critical",
        "No training step in 20 minutes on {{ $labels.instance }}",
        "The step counter has not moved for 20 minutes: the trainer is stuck "
        "(rollout engines, a collective, storage).",
    ),
    Alert(
        "RLFTCheckpointTooOld",
        # The timestamp is 0 until the first commit: then the age counts from the start.
        f"(time() - (({M.CHECKPOINT_TIME.name} > 0) or {M.START_TIME.name})) "
        f"> 2 * {M.CHECKPOINT_INTERVAL.name}",
        "5m",
        "warning",
        "Last checkpoint of {{ $labels.instance }} is too old",
        "No checkpoint committed for more than twice spec.checkpoint.intervalMinutes: a "
        "crash now would lose that much work.",
    ),
    Alert(
        "RLFTCheckpointFailing",
        # The gauge is 0 before the first attempt too: a failure must have been counted.
        f"{M.CHECKPOINT_OK.name} == 0 "
        f'and ignoring(result) {M.CHECKPOINTS.name}{{result="failed"}} > 0',
        "10m",
        "warning",
        "Checkpoints of {{ $labels.instance }} are failing",
        "The last checkpoint attempt failed and none has succeeded since.",
    ),
    Alert(
        "RLFTRestartStorm",
        # The operator's series of a job appears at its first restart, already at 1:
        # increase() misses that one, the difference with an hour ago does not (but
        # misses restarts across a reset of the operator's counter: hence both). One
        # operator scraped twice (a ServiceMonitor and a PodMonitor) counts once: max per
        # instance, summed over instances (a new leader's count adds to the last's).
        f"{_per_job(f'increase({_RESTARTS}[1h])')} >= 3 "
        f"or {_per_job(f'{_RESTARTS} - ({_RESTARTS} offset 1h or {_RESTARTS} * 0)')} >= 3 "
        f"or changes({M.START_TIME.name}[1h]) >= 3",
        "0m",
        "critical",
        "Trainer restarting repeatedly",
        "Three or more trainer restarts within an hour: look at the last failure in the "
        "RLFineTune status before it exhausts restartPolicy.maxRestarts.",
    ),
    Alert(
        "RLFTRolloutStalenessHigh",
        f"(increase({M.STALE_DROPPED.name}[10m]) "
        f"/ clamp_min(increase({M.SAMPLES.name}[10m]), 1)) > 0.2 "
        # Not a mean lag at the limit: that is the async pipeline's steady state when
        # generation keeps up (each batch starts as soon as the gate lets it).
        f"or (avg_over_time({M.TRAINER_IDLE.name}[10m]) > 0.5 "
        f"and {M.STALENESS_LIMIT.name} > 0)",
        "5m",
        "warning",
        "Rollouts of {{ $labels.instance }} cannot keep up",
        "More than 20% of completions are dropped for exceeding maxStaleness, or the "
        "trainer waits for rollouts more than half of the time although maxStaleness lets "
        "generation run ahead: add rollout instances or raise maxStaleness.",
    ),
    Alert(
        "RLFTRolloutEnginesDown",
        f"{M.ENGINES_HEALTHY.name} == 0 and {M.ENGINES_EXPECTED.name} > 0",
        "1m",
        "critical",
        "All rollout engines of {{ $labels.instance }} are down",
        "No rollout engine answers /healthz: training is stalled.",
    ),
    Alert(
        "RLFTRolloutEnginesDegraded",
        f"{M.ENGINES_HEALTHY.name} < {M.ENGINES_EXPECTED.name}",
        "5m",
        "warning",
        "Some rollout engines of {{ $labels.instance }} are down",
        "{{ $value }} rollout engines answer /healthz, fewer than spec.rollout.instances.",
    ),
)


def rules_document() -> dict[str, Any]:
    """The Prometheus rule file (also the `spec` of a PrometheusRule object)."""
    return {"groups": [{"name": GROUP, "rules": [a.to_rule() for a in ALERTS]}]}


def metrics_used(alert: Alert) -> list[str]:
    """Defined metric names an alert's expression refers to."""
    names = []
    for metric in M.METRICS:
        if metric.name in alert.expr:
            names.append(metric.name)
    return names
