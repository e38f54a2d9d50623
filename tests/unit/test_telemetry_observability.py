"""The generated alert rules and dashboard: fresh, consistent with the metric
definitions, and valid for the real promtool (rule syntax and alert unit tests)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rlft.trainer.telemetry import metrics as M
from rlft.trainer.telemetry.alerts import ALERTS, metrics_used
from rlft.trainer.telemetry.generate import DASHBOARD, RULES, stale, write

REPO = Path(__file__).resolve().parents[2]
HOW_TO_INSTALL = (
    "promtool is not installed: run `make setup` (it installs Debian's `prometheus` "
    "package where apt-get is available) or `sudo apt-get install prometheus`"
)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(HOW_TO_INSTALL)
    return path


def test_generated_files_are_fresh():
    assert stale(REPO) == [], "run: python -m rlft.trainer.telemetry.generate"


def test_stale_files_are_detected_and_rewritten(tmp_path: Path):
    assert set(stale(tmp_path)) == {RULES, DASHBOARD}
    write(tmp_path)
    assert stale(tmp_path) == []
    (tmp_path / RULES).write_text((tmp_path / RULES).read_text().replace("10m", "11m"))
    assert stale(tmp_path) == [RULES]


def test_alerts_only_name_defined_metrics():
    defined = {m.name for m in M.METRICS}
    for alert in ALERTS:
        named = set(re.findall(r"\brlft_[a-z0-9_]+", alert.expr))
        assert named, alert.name
        assert named <= defined, f"{alert.name} uses undefined {named - defined}"
        assert metrics_used(alert)
        assert alert.severity in ("warning", "critical")
    names = {a.name for a in ALERTS}
    for required in ("RLFTGradientSpike", "RLFTCollapsed", "RLFTNonFiniteValues",
                     "RLFTNoProgress", "RLFTCheckpointTooOld", "RLFTRestartStorm",
                     "RLFTRolloutStalenessHigh", "RLFTRolloutEnginesDown"):  # fmt: skip
        assert required in names


def test_every_alert_has_a_promtool_unit_test():
    tested = set()
    for path in (REPO / "observability/tests").glob("*.yaml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            tested |= {case["alertname"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert tested == {a.name for a in ALERTS}


def test_dashboard_draws_every_metric():
    board = json.loads((REPO / DASHBOARD).read_text())
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    for metric in M.METRICS:
        assert metric.name in exprs, metric.name
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "job", "instance"}


def test_unix_times_are_drawn_as_ages_not_values():
    """A start or last-success time as a value in seconds reads as about 55 years."""
    board = json.loads((REPO / DASHBOARD).read_text())
    by_title = {p["title"]: p for p in board["panels"] if p.get("targets")}
    panel = by_title["checkpoint last success timestamp seconds (age)"]
    assert panel["fieldConfig"]["defaults"]["unit"] == "s"
    assert panel["targets"][0]["expr"].startswith(
        "time() - (rlft_checkpoint_last_success_timestamp_seconds{"
    )
    assert panel["targets"][0]["expr"].endswith("} > 0)")  # 0: none yet, no age
    assert "trainer start time seconds (age)" in by_title


def test_promtool_check_rules():
    result = subprocess.run(
        [promtool(), "check", "rules", str(REPO / RULES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_promtool_test_rules():
    tests = sorted(str(p) for p in (REPO / "observability/tests").glob("*.yaml"))
    assert tests
    result = subprocess.run(
        [promtool(), "test", "rules", *tests], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _series_of(exporter, minutes: int, moving: str | None = None) -> list[dict]:
    """What a real trainer's /metrics exports now, held for `minutes` (the `moving`
    metric goes up by one a minute instead), as promtool input series (the `_created`
    samples are prometheus_client's, not ours)."""
    from prometheus_client.parser import text_string_to_metric_families

    series = []
    text = exporter.exposition().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = {"job": "trainer", "instance": "a", **sample.labels}
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            step = "+1" if sample.name == moving else ""
            values = f"{sample.value}{step}x{minutes}"
            series.append({"series": f"{sample.name}{{{inner}}}", "values": values})
    return series


def _firing_on_a(alert) -> dict:
    def text(template: str) -> str:
        return template.replace("{{ $labels.instance }}", "a")

    return {
        "exp_labels": {"severity": alert.severity, "job": "trainer", "instance": "a"},
        "exp_annotations": {"summary": text(alert.summary), "description": text(alert.description)},
    }


def _promtool_expects(tmp_path: Path, series: list[dict], at: str, firing: set[str]) -> None:
    cases = [
        {
            "eval_time": at,
            "alertname": alert.name,
            "exp_alerts": [_firing_on_a(alert)] if alert.name in firing else [],
        }
        for alert in ALERTS
    ]
    _promtool_alerts(tmp_path, series, cases)


def _promtool_alerts(tmp_path: Path, series: list[dict], cases: list[dict]) -> None:
    test = {
        "rule_files": [str(REPO / RULES)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": cases}],
    }
    path = tmp_path / "scraped.test.yaml"
    path.write_text(yaml.safe_dump(test))
    result = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_fresh_trainers_metrics_raise_no_alert(tmp_path: Path):
    """The series a real exporter serves before its first checkpoint (the checkpoint
    gauges exported at 0), 30 minutes on, through the real rules: nothing fires. Both
    checkpoint alerts used to (a commit at Unix time 0; a last attempt that "failed")."""
    from rlft.trainer.telemetry.exporter import MetricsExporter

    exporter = MetricsExporter(start_time=1200.0)  # promtool's clock starts at 0
    exporter.configure(staleness_limit=2, checkpoint_interval_s=600)
    exporter.record({"step": 1, "policy_version": 1, "grad_norm": 1.0, "loss": 0.5})
    series = _series_of(exporter, 40, moving=M.TRAIN_STEP.name)
    _promtool_expects(tmp_path, series, "30m", firing=set())


def test_a_failed_checkpoint_in_a_real_exporter_fires_checkpoint_failing(tmp_path: Path):
    from rlft.trainer.telemetry.exporter import MetricsExporter

    exporter = MetricsExporter(start_time=0.0)
    exporter.configure(staleness_limit=2, checkpoint_interval_s=3600)
    exporter.checkpoint(2, ok=False)
    _promtool_expects(tmp_path, _series_of(exporter, 20), "15m", {"RLFTCheckpointFailing"})


def _scraped(scrapes: list[tuple[bytes, int]], labels: dict[str, str]) -> list[dict]:
    """Successive /metrics answers, each held for its minutes, as promtool input series:
    a series absent from a scrape (a labelled child not yet used) is absent (`_`) there."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[str]] = {}
    minutes = 0
    for text, held in scrapes:
        seen = set()
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                every = {**labels, **sample.labels}
                inner = ",".join(f'{k}="{v}"' for k, v in sorted(every.items()))
                key = f"{sample.name}{{{inner}}}"
                seen.add(key)
                values.setdefault(key, ["_"] * minutes).extend([str(sample.value)] * held)
        for key, column in values.items():
            if key not in seen:
                column.extend(["_"] * held)
        minutes += held
    return [{"series": key, "values": " ".join(column)} for key, column in values.items()]


def test_restart_storm_counts_the_operators_first_restart_of_a_job(tmp_path: Path):
    """The operator's rlft_restarts_total{rlfinetune} series appears at a job's first
    restart, already at 1 (prometheus_client exports a labelled child once it is used):
    increase() cannot see that first step, so the third restart of an hour read as two
    and RLFTRestartStorm waited for a fourth."""
    from prometheus_client import generate_latest

    from rlft.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    scrapes = [(generate_latest(metrics.registry), 5)]  # the job runs: no series yet
    for held in (5, 5, 60):  # a restart at 5m, 10m and 15m
        metrics.restarts.labels(rlfinetune="ml/storm").inc()
        scrapes.append((generate_latest(metrics.registry), held))
    storm = next(a for a in ALERTS if a.name == "RLFTRestartStorm")
    fired = {
        "exp_labels": {"severity": storm.severity, "rlfinetune": "ml/storm"},
        "exp_annotations": {"summary": storm.summary, "description": storm.description},
    }
    series = _scraped(scrapes, {"job": "operator", "instance": "op"})
    _promtool_alerts(
        tmp_path,
        series,
        [
            {"eval_time": "14m", "alertname": storm.name, "exp_alerts": []},
            {"eval_time": "16m", "alertname": storm.name, "exp_alerts": [fired]},
            {"eval_time": "64m", "alertname": storm.name, "exp_alerts": [fired]},
            {"eval_time": "66m", "alertname": storm.name, "exp_alerts": []},  # 5m: out
        ],
    )


def test_restart_storm_counts_an_operator_scraped_twice_once(tmp_path: Path):
    """The chart can scrape the operator through its ServiceMonitor and its PodMonitor
    both: each restart is then in two series (job labels apart). Summed as they were,
    two restarts read as four and RLFTRestartStorm fired."""
    from prometheus_client import generate_latest

    from rlft.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    scrapes = [(generate_latest(metrics.registry), 5)]
    for held in (5, 60):  # a restart at 5m and 10m
        metrics.restarts.labels(rlfinetune="ml/twice").inc()
        scrapes.append((generate_latest(metrics.registry), held))
    series = [
        *_scraped(scrapes, {"job": "operator-service", "instance": "10.0.0.5:8080"}),
        *_scraped(scrapes, {"job": "operator-pods", "instance": "10.0.0.5:8080"}),
    ]
    _promtool_alerts(
        tmp_path,
        series,
        [
            {"eval_time": time, "alertname": "RLFTRestartStorm", "exp_alerts": []}
            for time in ("11m", "30m", "60m")
        ],
    )


def test_a_collapse_rolled_back_between_two_scrapes_fires_collapsed(tmp_path: Path):
    """The health gauge says `collapsed` only from the collapse's decision to the next
    step's (the rollback restores a healthy detector): a scrape before and one after
    never saw it. The collapse is counted (rlft_detector_alarms_total, level critical
    of a trend check), and RLFTCollapsed fires on that count."""
    from rlft.trainer.stability.actions import StepGuard
    from rlft.trainer.telemetry.exporter import MetricsExporter
    from rlft.trainer.telemetry.hub import Telemetry

    telemetry = Telemetry(MetricsExporter(start_time=0.0))
    telemetry.configure(staleness_limit=2, checkpoint_interval_s=3600)
    guard = StepGuard(listener=telemetry)

    def step(n: int, entropy: float) -> str:
        record = {"step": n, "grad_norm": 1.0, "entropy": entropy, "reward_mean": 0.5}
        decision = guard.check(record)
        telemetry.record(record)
        return decision.action

    for n in range(1, 31):
        assert step(n, 1.0 + 0.01 * (n % 3)) == "apply"
    checkpoint = guard.state_dict()  # a healthy checkpoint
    scrapes = [(telemetry.exporter.exposition(), 10)]
    n = 30
    while (action := step(n := n + 1, 0.05)) != "rollback":
        assert action == "apply" and n < 60
    guard.restore_detector(checkpoint["detector"])
    guard.rolled_back()
    telemetry.on_rollback(guard.counters)
    assert step(n + 1, 1.0) == "apply"
    scrapes.append((telemetry.exporter.exposition(), 20))
    assert b"rlft_health_level 0.0" in scrapes[-1][0]  # collapsed in neither scrape
    series = _scraped(scrapes, {"job": "trainer", "instance": "a"})
    _promtool_alerts(
        tmp_path,
        series,
        [
            {
                "eval_time": at,
                "alertname": alert.name,
                "exp_alerts": [_firing_on_a(alert)] if firing else [],
            }
            for alert in ALERTS
            if alert.name in ("RLFTCollapsed", "RLFTRolledBack")
            for at, firing in (("9m", False), ("11m", True))
        ],
    )
