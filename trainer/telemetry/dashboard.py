"""The Grafana dashboard, written from the metric definitions.

One row per `Metric.panel`, one time-series panel per metric: gauges as they are,
counters as per-second rates, histograms as p50/p95. A `job`/`instance` variable
selects the run. `python -m rlft.trainer.telemetry.generate` writes it to
observability/grafana/rlft.json (import it in Grafana, pick the Prometheus source).
"""

from __future__ import annotations

from typing import Any

from rlft.trainer.telemetry import metrics as M

UID = "rlft-training"
_SELECTOR = 'job=~"$job", instance=~"$instance"'
_ANY = '__name__=~"rlft_.*"'
"""Every series rlft exports (a selector's matcher)."""
_UNITS = {
    "seconds": "s",
    "tokens": "short",
    "tokens_per_second": "short",
    "ratio": "percentunit",
    "nats": "short",
    "step": "short",
    "version": "short",
    "": "short",
}


def _is_time(metric: M.Metric) -> bool:
    """A Unix time (a start, a last success): drawn as an age, a duration Grafana can show
    (as a value it read as about 55 years)."""
    return metric.name.endswith(("_timestamp_seconds", "_start_time_seconds"))


def _targets(metric: M.Metric) -> list[dict[str, Any]]:
    legend = "{{instance}}" + "".join(f" {label}={{{{{label}}}}}" for label in metric.labels)
    if metric.kind == "counter":
        expr = f"rate({metric.name}{{{_SELECTOR}}}[5m])"
        return [{"refId": "A", "expr": expr, "legendFormat": legend}]
    if metric.kind == "histogram":
        return [
            {
                "refId": ref,
                "expr": f"histogram_quantile({q}, sum by (le, instance) "
                f"(rate({metric.name}_bucket{{{_SELECTOR}}}[5m])))",
                "legendFormat": f"p{int(q * 100)} {{{{instance}}}}",
            }
            for ref, q in (("A", 0.5), ("B", 0.95))
        ]
    if _is_time(metric):  # 0 is "not yet": no age
        expr = f"time() - ({metric.name}{{{_SELECTOR}}} > 0)"
        return [{"refId": "A", "expr": expr, "legendFormat": legend}]
    return [{"refId": "A", "expr": f"{metric.name}{{{_SELECTOR}}}", "legendFormat": legend}]


def _panel(metric: M.Metric, panel_id: int, x: int, y: int) -> dict[str, Any]:
    title = metric.name.removeprefix("rlft_").replace("_", " ")
    if metric.kind == "counter":
        title += " (per second)"
    elif _is_time(metric):
        title += " (age)"
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": metric.help,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": _UNITS[metric.unit]}, "overrides": []},
        "targets": _targets(metric),
    }


def dashboard() -> dict[str, Any]:
    """The dashboard JSON model."""
    panels: list[dict[str, Any]] = []
    rows: dict[str, list[M.Metric]] = {}
    for metric in M.METRICS:
        rows.setdefault(metric.panel, []).append(metric)
    panel_id, y = 1, 0
    for row, metrics in rows.items():
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y = panel_id + 1, y + 1
        for index, metric in enumerate(metrics):
            x = (index % 3) * 8
            if index and index % 3 == 0:
                y += 8
            panels.append(_panel(metric, panel_id, x, y))
            panel_id += 1
        y += 8
    # The choices come from every rlft series (trainers, rollout pods, the operator), and
    # "All" is any value: a trainer's series alone left the rollout and operator panels
    # empty, their job and instance labels not among the choices.
    variable = {
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "refresh": 2,
        "current": {"selected": True, "text": "All", "value": "$__all"},
    }
    return {
        "uid": UID,
        "title": "rlft: RL post-training",
        "description": "Generated from rlft.trainer.telemetry.metrics; do not edit by hand.",
        "tags": ["rlft"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "current": {}},
                {**variable, "name": "job", "query": f"label_values({{{_ANY}}}, job)"},
                {
                    **variable,
                    "name": "instance",
                    "query": f'label_values({{{_ANY}, job=~"$job"}}, instance)',
                },
            ]
        },
        "panels": panels,
    }
