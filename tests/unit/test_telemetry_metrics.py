"""Metric definitions follow the naming rules, and a step record becomes the right
Prometheus samples."""

from __future__ import annotations

import math
import re

from prometheus_client.parser import text_string_to_metric_families

from rlft.trainer.telemetry import metrics as M
from rlft.trainer.telemetry.exporter import MetricsExporter

# The keys of one line of metrics.jsonl as the local trainer writes it today.
RECORD_KEYS = [
    "step", "policy_version", "reward_mean", "reward_std", "train_accuracy", "loss",
    "grad_norm", "kl", "entropy", "clip_fraction", "ratio_mean", "response_len_mean",
    "truncated_fraction", "gen_time_s", "train_time_s", "step_time_s", "lr", "tokens",
    "eval_accuracy",
]  # fmt: skip


def samples(exporter: MetricsExporter) -> dict[tuple[str, tuple], float]:
    text = exporter.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_names_follow_prometheus_conventions():
    assert len({m.name for m in M.METRICS}) == len(M.METRICS)
    for metric in M.METRICS:
        assert re.fullmatch(r"rlft_[a-z0-9_]+", metric.name), metric.name
        assert metric.unit in M.UNITS, metric.name
        base = metric.name.removesuffix("_total")
        assert (metric.name != base) == (metric.kind == "counter"), metric.name
        if metric.unit:
            assert base.endswith("_" + metric.unit), f"{metric.name} lacks unit {metric.unit}"
        assert metric.help.endswith("."), metric.name
        assert (metric.kind == "histogram") == bool(metric.buckets), metric.name


def test_bindings_point_at_defined_metrics_with_their_labels():
    for key, binding in M.BINDINGS.items():
        assert M.BY_NAME[binding.metric.name] is binding.metric, key
        labels = set(binding.labels) | ({binding.dict_label} if binding.dict_label else set())
        assert labels == set(binding.metric.labels), key
        assert binding.metric.source == "trainer", key
    phases = {b.labels["phase"] for b in M.BINDINGS.values() if b.metric is M.STEP_PHASE}
    assert phases == set(M.PHASES)


def test_every_key_the_trainer_writes_is_exported():
    assert M.unbound_keys(dict.fromkeys(RECORD_KEYS, 1.0)) == []
    assert M.unbound_keys({"step": 1, "something_new": 2}) == ["something_new"]


def test_a_record_becomes_samples():
    exporter = MetricsExporter(start_time=1000.0)
    record = {
        "step": 12, "policy_version": 12, "loss": -0.25, "grad_norm": 3.5, "entropy": 0.4,
        "reward_mean": 0.7, "ratio_max": 4.0, "gen_time_s": 0.5, "train_time_s": 1.5,
        "step_time_s": 2.0, "tokens": 1000, "samples": 256, "stale_dropped": 3,
        "grad_norm_groups": {"embed": 0.5, "layers.0": 2.0}, "unknown": 5.0, "note": "text",
    }  # fmt: skip
    exporter.record(record)
    exporter.record({**record, "step": 13, "tokens": 500})
    got = samples(exporter)
    assert got[("rlft_train_step", ())] == 13
    assert got[("rlft_train_loss", ())] == -0.25
    assert got[("rlft_grad_norm_group", (("group", "layers.0"),))] == 2.0
    assert got[("rlft_importance_ratio", (("stat", "max"),))] == 4.0
    assert got[("rlft_step_phase_seconds", (("phase", "generate"),))] == 0.5
    assert got[("rlft_step_phase_seconds", (("phase", "train"),))] == 1.5
    assert got[("rlft_trained_tokens_total", ())] == 1500  # counters add per-step values
    assert got[("rlft_stale_samples_dropped_total", ())] == 6
    assert got[("rlft_throughput_tokens_per_second", ())] == 250  # derived: 500 / 2.0
    assert got[("rlft_trainer_start_time_seconds", ())] == 1000.0
    # Alert rules need these series to exist at 0 before anything happens.
    assert got[("rlft_skipped_updates_total", ())] == 0
    key = ("rlft_detector_alarms_total", (("check", "grad_norm_spike"), ("level", "critical")))
    assert got[key] == 0


def test_a_gauge_is_exported_once_it_has_a_value():
    """Unset gauges are absent, not 0: a dashboard showed 0% held-out accuracy before the
    first evaluation, and 0 KL for a job with no reference. The step count is there from
    the start (a run stuck before its first step is told by it)."""
    exporter = MetricsExporter()
    names = {name for name, _ in samples(exporter)}
    assert "rlft_train_step" in names and "rlft_trainer_start_time_seconds" in names
    assert not names & {"rlft_eval_accuracy_ratio", "rlft_kl_nats", "rlft_train_loss"}
    exporter.record({"step": 1, "loss": 0.0, "eval_accuracy": 0.0})
    after = samples(exporter)
    assert after[("rlft_train_loss", ())] == 0.0
    assert after[("rlft_eval_accuracy_ratio", ())] == 0.0
    assert ("rlft_kl_nats", ()) not in after
    exporter.checkpoint(step=1, ok=True, when=5.0)
    assert samples(exporter)[("rlft_checkpoint_last_success_timestamp_seconds", ())] == 5.0


def test_nan_is_exported_as_nan_and_counters_ignore_it():
    exporter = MetricsExporter()
    exporter.record({"loss": math.nan, "tokens": math.nan, "grad_norm": math.inf})
    got = samples(exporter)
    assert math.isnan(got[("rlft_train_loss", ())])
    assert got[("rlft_grad_norm", ())] == math.inf
    assert got[("rlft_trained_tokens_total", ())] == 0


def test_decisions_and_checkpoints():
    exporter = MetricsExporter()
    exporter.decision("warning", {"grad_norm_spike": 2, "entropy_collapse": 1}, 9.5, "skip")
    exporter.decision("collapsed", {"reward_collapse": 2}, None, "rollback")
    assert samples(exporter)[("rlft_rollbacks_total", ())] == 0  # decided, not made yet
    exporter.rolled_back()
    exporter.checkpoint(50, ok=True, when=123.0)
    exporter.checkpoint(60, ok=False)
    exporter.configure(staleness_limit=2, checkpoint_interval_s=1800)
    got = samples(exporter)
    assert got[("rlft_health_level", ())] == 2
    assert got[("rlft_grad_norm_zscore", ())] == 9.5
    assert got[("rlft_skipped_updates_total", ())] == 1
    assert got[("rlft_rollbacks_total", ())] == 1
    alarms = "rlft_detector_alarms_total"
    assert got[(alarms, (("check", "grad_norm_spike"), ("level", "critical")))] == 1
    assert got[(alarms, (("check", "entropy_collapse"), ("level", "warning")))] == 1
    assert got[("rlft_detector_check_level", (("check", "grad_norm_spike"),))] == 0
    assert got[("rlft_detector_check_level", (("check", "reward_collapse"),))] == 2
    assert got[("rlft_checkpoint_last_success_timestamp_seconds", ())] == 123.0
    assert got[("rlft_checkpoint_last_step", ())] == 50
    assert got[("rlft_checkpoint_last_ok", ())] == 0
    assert got[("rlft_checkpoints_total", (("result", "failed"),))] == 1
    assert got[("rlft_staleness_limit_step", ())] == 2


def test_rollout_source_gets_only_rollout_metrics():
    exporter = MetricsExporter(source="rollout")
    names = set(exporter.collectors)
    assert names == {m.name for m in M.METRICS if m.source == "rollout"}
    assert "rlft_rollout_request_duration_seconds" in names


def test_operator_side_modules_import_neither_torch_nor_exporters():
    """The operator image has no torch; rules, dashboard and detector must not need it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import rlft.trainer.telemetry.metrics, rlft.trainer.telemetry.alerts\n"
        "import rlft.trainer.telemetry.dashboard, rlft.trainer.config.telemetry\n"
        "import rlft.trainer.stability.actions, rlft.trainer.stability.detector\n"
        "heavy = {'torch', 'prometheus_client', 'opentelemetry'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
