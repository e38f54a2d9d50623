"""Every metric rlft exports, defined once.

The trainer's exporter, the rollout server, the Prometheus alert rules
(`rlft.trainer.telemetry.alerts`) and the Grafana dashboard
(`rlft.trainer.telemetry.dashboard`) all take names from here, so a rename cannot leave
an alert watching a series that no longer exists.

Naming follows Prometheus' guide: the `rlft_` prefix, the base unit as suffix
(`_seconds`, `_tokens`, `_nats`, `_ratio` for fractions in [0, 1], `_step`, `_version`),
`_total` after the unit for counters. Dimensionless quantities that are not fractions
(loss, gradient norm, reward, importance ratio) carry no unit suffix, as the guide says.

`BINDINGS` maps the keys of the trainer's per-step record (one line of metrics.jsonl)
to metrics, so the training loop exports a step with `exporter.record(step_record)` and
never names a metric itself. Pure data: no prometheus_client, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["gauge", "counter", "histogram"]
Source = Literal["trainer", "rollout", "operator"]

UNITS = ("seconds", "tokens", "tokens_per_second", "nats", "ratio", "step", "version", "")
"""Allowed unit suffixes; "" is a dimensionless quantity that is not a fraction."""

PHASES = ("generate", "score", "train", "publish_weights", "checkpoint")
"""Phases of one training step (labels of rlft_step_phase_seconds and span names)."""

CHECKS = (
    "non_finite",
    "grad_norm_spike",
    "sustained_spikes",
    "entropy_collapse",
    "kl_blowup",
    "reward_collapse",
    "importance_ratio_blowup",
    "expert_load_collapse",
)
"""Checks of the collapse detector (label `check` of its metrics)."""

HEALTH_LEVELS = {"ok": 0, "warning": 1, "collapsed": 2}
"""Values of rlft_health_level."""


@dataclass(frozen=True)
class Metric:
    """One exported time series family."""

    name: str
    kind: Kind
    help: str
    unit: str = ""
    labels: tuple[str, ...] = ()
    source: Source = "trainer"
    panel: str = "Training"
    """Dashboard row the metric is drawn in."""
    buckets: tuple[float, ...] = ()
    """Histogram buckets (histograms only)."""


def _m(name: str, kind: Kind, help: str, unit: str = "", **kw) -> Metric:
    return Metric(name=name, kind=kind, help=help, unit=unit, **kw)


# ---------------------------------------------------------------- progress
TRAIN_STEP = _m("rlft_train_step", "gauge", "Optimizer steps completed.", "step", panel="Progress")
POLICY_VERSION = _m(
    "rlft_policy_version",
    "gauge",
    "Version of the policy being trained.",
    "version",
    panel="Progress",
)
LEARNING_RATE = _m(
    "rlft_learning_rate", "gauge", "Learning rate of the last step.", panel="Progress"
)
CRITIC_LEARNING_RATE = _m(
    "rlft_critic_learning_rate",
    "gauge",
    "Learning rate of the critic (PPO) in the last step.",
    panel="Progress",
)
STEP_DURATION = _m(
    "rlft_step_duration_seconds",
    "gauge",
    "Wall time of the last step.",
    "seconds",
    panel="Throughput",
)
STEP_PHASE = _m(
    "rlft_step_phase_seconds",
    "gauge",
    "Wall time of each phase of the last step.",
    "seconds",
    labels=("phase",),
    panel="Throughput",
)
THROUGHPUT = _m(
    "rlft_throughput_tokens_per_second",
    "gauge",
    "Trained completion tokens per second of step wall time.",
    "tokens_per_second",
    panel="Throughput",
)
TOKENS_TRAINED = _m(
    "rlft_trained_tokens_total",
    "counter",
    "Completion tokens trained on.",
    "tokens",
    panel="Throughput",
)
START_TIME = _m(
    "rlft_trainer_start_time_seconds",
    "gauge",
    "Unix time the trainer process started (a change means a restart).",
    "seconds",
    panel="Progress",
)
MAIN_PHASE_START = _m(
    "rlft_main_phase_start_time_seconds",
    "gauge",
    "Unix time this trainer process began the algorithm's steps (0 during the warm start).",
    "seconds",
    panel="Progress",
)
# ------------------------------------------------------------- optimisation
LOSS = _m("rlft_train_loss", "gauge", "Training loss of the last step.", panel="Optimisation")
GRAD_NORM = _m(
    "rlft_grad_norm", "gauge", "Global L2 gradient norm before clipping.", panel="Optimisation"
)
GRAD_NORM_GROUP = _m(
    "rlft_grad_norm_group",
    "gauge",
    "L2 gradient norm before clipping, per parameter group.",
    labels=("group",),
    panel="Optimisation",
)
GRAD_NORM_ZSCORE = _m(
    "rlft_grad_norm_zscore",
    "gauge",
    "Robust z-score of log gradient norm against the detector's rolling median/MAD.",
    panel="Optimisation",
)
CLIP_FRACTION = _m(
    "rlft_clipped_tokens_ratio",
    "gauge",
    "Fraction of tokens whose importance ratio was clipped.",
    "ratio",
    panel="Optimisation",
)
# ------------------------------------------------------------------ policy
KL = _m(
    "rlft_kl_nats", "gauge", "Mean per-token KL to the reference policy.", "nats", panel="Policy"
)
ENTROPY = _m(
    "rlft_entropy_nats", "gauge", "Mean per-token entropy of the policy.", "nats", panel="Policy"
)
IMPORTANCE_RATIO = _m(
    "rlft_importance_ratio",
    "gauge",
    "Train/inference importance ratio of trained tokens (stat = mean, max or min).",
    labels=("stat",),
    panel="Policy",
)
RATIO_TRUNCATED = _m(
    "rlft_importance_ratio_truncated_ratio",
    "gauge",
    "Fraction of tokens whose importance weight was truncated.",
    "ratio",
    panel="Policy",
)
RATIO_MASKED = _m(
    "rlft_importance_ratio_masked_ratio",
    "gauge",
    "Fraction of tokens masked out for an extreme importance ratio.",
    "ratio",
    panel="Policy",
)
EXPERT_IMBALANCE = _m(
    "rlft_expert_load_imbalance",
    "gauge",
    "MoE expert load imbalance: max over experts of load / mean load (worst layer; 1 = even).",
    panel="Policy",
)
EXPERT_DEAD = _m(
    "rlft_expert_dead_ratio",
    "gauge",
    "Fraction of MoE experts receiving (almost) no tokens (worst layer).",
    "ratio",
    panel="Policy",
)
# ----------------------------------------------------------------- rewards
REWARD_MEAN = _m(
    "rlft_reward_mean", "gauge", "Mean reward of the step's completions.", panel="Rewards"
)
REWARD_STD = _m(
    "rlft_reward_std", "gauge", "Standard deviation of the step's rewards.", panel="Rewards"
)
TRAIN_ACCURACY = _m(
    "rlft_train_accuracy_ratio",
    "gauge",
    "Exact-match accuracy of the step's completions.",
    "ratio",
    panel="Rewards",
)
EVAL_ACCURACY = _m(
    "rlft_eval_accuracy_ratio",
    "gauge",
    "Held-out exact-match accuracy (greedy).",
    "ratio",
    panel="Rewards",
)
RESPONSE_LENGTH = _m(
    "rlft_response_length_tokens", "gauge", "Mean completion length.", "tokens", panel="Rewards"
)
TRUNCATED = _m(
    "rlft_truncated_responses_ratio",
    "gauge",
    "Fraction of completions cut at maxNewTokens.",
    "ratio",
    panel="Rewards",
)
# ----------------------------------------------------------------- rollout
STALENESS = _m(
    "rlft_staleness_step",
    "gauge",
    "Policy lag of trained samples in steps (stat = mean or max).",
    "step",
    labels=("stat",),
    panel="Rollout",
)
STALENESS_LIMIT = _m(
    "rlft_staleness_limit_step", "gauge", "Configured maxStaleness.", "step", panel="Rollout"
)
SAMPLES = _m(
    "rlft_samples_generated_total",
    "counter",
    "Completions received from rollout engines.",
    panel="Rollout",
)
TRAINER_IDLE = _m(
    "rlft_trainer_idle_ratio",
    "gauge",
    "Share of the last step's wall time the trainer waited for rollouts.",
    "ratio",
    panel="Rollout",
)
GENERATION_THROUGHPUT = _m(
    "rlft_generation_tokens_per_second",
    "gauge",
    "Completion tokens the rollout engines generated per second for the last batch.",
    "tokens_per_second",
    panel="Rollout",
)
REISSUED = _m(
    "rlft_rollout_requests_reissued_total",
    "counter",
    "Generation requests re-sent to another instance after one died or timed out.",
    panel="Rollout",
)
STALE_DROPPED = _m(
    "rlft_stale_samples_dropped_total",
    "counter",
    "Completions dropped for exceeding maxStaleness.",
    panel="Rollout",
)
ENGINES_HEALTHY = _m(
    "rlft_rollout_engines_healthy",
    "gauge",
    "Rollout engine instances answering /healthz.",
    panel="Rollout",
)
ENGINES_EXPECTED = _m(
    "rlft_rollout_engines_expected",
    "gauge",
    "Rollout engine instances the job asks for.",
    panel="Rollout",
)
ROLLOUT_REQUESTS = _m(
    "rlft_rollout_requests_total",
    "counter",
    "Requests answered, by status: ok (generate requests served), error, unavailable, "
    "bad_request, unauthorized, superseded (a replaced trainer gang's weights refused).",
    labels=("status",),
    source="rollout",
    panel="Rollout",
)
ROLLOUT_TOKENS = _m(
    "rlft_rollout_generated_tokens_total",
    "counter",
    "Completion tokens generated.",
    "tokens",
    source="rollout",
    panel="Rollout",
)
ROLLOUT_VERSION = _m(
    "rlft_rollout_policy_version",
    "gauge",
    "Policy version the engine serves.",
    "version",
    source="rollout",
    panel="Rollout",
)
ROLLOUT_LATENCY = _m(
    "rlft_rollout_request_duration_seconds",
    "histogram",
    "Duration of generate requests.",
    "seconds",
    source="rollout",
    panel="Rollout",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
# -------------------------------------------------------------- checkpoints
CHECKPOINT_TIME = _m(
    "rlft_checkpoint_last_success_timestamp_seconds",
    "gauge",
    "Unix time of the last committed checkpoint.",
    "seconds",
    panel="Checkpoints",
)
CHECKPOINT_STEP = _m(
    "rlft_checkpoint_last_step",
    "gauge",
    "Step of the last committed checkpoint.",
    "step",
    panel="Checkpoints",
)
CHECKPOINT_OK = _m(
    "rlft_checkpoint_last_ok",
    "gauge",
    "1 if the last checkpoint attempt committed, 0 if it failed.",
    panel="Checkpoints",
)
CHECKPOINT_RETRIES = _m(
    "rlft_checkpoint_upload_retries_total",
    "counter",
    "Checkpoint storage operations retried after a throttling or connection error.",
    panel="Checkpoints",
)
CHECKPOINTS = _m(
    "rlft_checkpoints_total",
    "counter",
    "Checkpoint attempts by result (ok or failed).",
    labels=("result",),
    panel="Checkpoints",
)
CHECKPOINT_INTERVAL = _m(
    "rlft_checkpoint_interval_seconds",
    "gauge",
    "Configured checkpoint intervalMinutes, in seconds.",
    "seconds",
    panel="Checkpoints",
)
# ------------------------------------------------------------------ health
HEALTH = _m(
    "rlft_health_level", "gauge", "Detector verdict: 0 ok, 1 warning, 2 collapsed.", panel="Health"
)
CHECK_LEVEL = _m(
    "rlft_detector_check_level",
    "gauge",
    "Level of each detector check at the last step (0-2).",
    labels=("check",),
    panel="Health",
)
ALARMS = _m(
    "rlft_detector_alarms_total",
    "counter",
    "Steps a detector check flagged, by level.",
    labels=("check", "level"),
    panel="Health",
)
SKIPPED = _m(
    "rlft_skipped_updates_total",
    "counter",
    "Updates zeroed before optimizer.step().",
    panel="Health",
)
ROLLBACKS = _m(
    "rlft_rollbacks_total",
    "counter",
    "In-process rollbacks to the last healthy checkpoint.",
    panel="Health",
)
RESTARTS = _m(
    "rlft_restarts_total",
    "counter",
    "Trainer pod group restarts made by the operator.",
    labels=("rlfinetune",),
    source="operator",
    panel="Health",
)

METRICS: tuple[Metric, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Metric))
"""Every metric, in definition order."""

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}


@dataclass(frozen=True)
class Binding:
    """How one key of the per-step record is exported.

    A float value sets a gauge (or, for a counter, is added to it: records carry
    per-step increments). A dict value exports one series per key under `dict_label`.
    """

    metric: Metric
    labels: dict[str, str] = field(default_factory=dict)
    dict_label: str | None = None


BINDINGS: dict[str, Binding] = {
    "step": Binding(TRAIN_STEP),
    "policy_version": Binding(POLICY_VERSION),
    "lr": Binding(LEARNING_RATE),
    "loss": Binding(LOSS),
    "grad_norm": Binding(GRAD_NORM),
    "grad_norm_groups": Binding(GRAD_NORM_GROUP, dict_label="group"),
    "clip_fraction": Binding(CLIP_FRACTION),
    "kl": Binding(KL),
    "entropy": Binding(ENTROPY),
    "ratio_mean": Binding(IMPORTANCE_RATIO, {"stat": "mean"}),
    "ratio_max": Binding(IMPORTANCE_RATIO, {"stat": "max"}),
    "ratio_min": Binding(IMPORTANCE_RATIO, {"stat": "min"}),
    "ratio_truncated_fraction": Binding(RATIO_TRUNCATED),
    "ratio_masked_fraction": Binding(RATIO_MASKED),
    "expert_imbalance_max": Binding(EXPERT_IMBALANCE),
    "expert_dead_fraction": Binding(EXPERT_DEAD),
    "reward_mean": Binding(REWARD_MEAN),
    "reward_std": Binding(REWARD_STD),
    "train_accuracy": Binding(TRAIN_ACCURACY),
    "eval_accuracy": Binding(EVAL_ACCURACY),
    "response_len_mean": Binding(RESPONSE_LENGTH),
    "truncated_fraction": Binding(TRUNCATED),
    "staleness_mean": Binding(STALENESS, {"stat": "mean"}),
    "staleness_max": Binding(STALENESS, {"stat": "max"}),
    "samples": Binding(SAMPLES),
    "stale_dropped": Binding(STALE_DROPPED),
    "trainer_idle_ratio": Binding(TRAINER_IDLE),
    "gen_tokens_per_s": Binding(GENERATION_THROUGHPUT),
    "reissued_requests": Binding(REISSUED),
    "rollout_engines_healthy": Binding(ENGINES_HEALTHY),
    "rollout_engines_expected": Binding(ENGINES_EXPECTED),
    "critic_lr": Binding(CRITIC_LEARNING_RATE),
    "tokens": Binding(TOKENS_TRAINED),
    "tokens_per_s": Binding(THROUGHPUT),
    "step_time_s": Binding(STEP_DURATION),
    "gen_time_s": Binding(STEP_PHASE, {"phase": "generate"}),
    "score_time_s": Binding(STEP_PHASE, {"phase": "score"}),
    "train_time_s": Binding(STEP_PHASE, {"phase": "train"}),
    "publish_time_s": Binding(STEP_PHASE, {"phase": "publish_weights"}),
    "checkpoint_time_s": Binding(STEP_PHASE, {"phase": "checkpoint"}),
}
"""Record key → metric. Keys not listed here are ignored by the exporter (and listed by
`unbound_keys`, so a test can insist that every key the loop writes is exported)."""


def derived(record: dict) -> dict:
    """Values computed from others when the loop did not write them (throughput)."""
    extra = {}
    if "tokens_per_s" not in record and record.get("step_time_s") and "tokens" in record:
        extra["tokens_per_s"] = record["tokens"] / record["step_time_s"]
    return extra


def unbound_keys(record: dict) -> list[str]:
    """Record keys that no metric exports."""
    return sorted(k for k in record if k not in BINDINGS)
