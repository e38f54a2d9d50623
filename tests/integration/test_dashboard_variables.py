"""The Grafana dashboard against a real Prometheus scraping the three real sources of
rlft's series: a trainer's telemetry server, a rollout server and the operator's
/metrics, each as a scrape job of its own (as their PodMonitors and ServiceMonitor make
them). Its `job` and `instance` variables are resolved as Grafana resolves them (the
label values API with the variable's series selector; "All" is the variable's
allValue, else the regex of every value found), and every panel of a series that
Prometheus holds must draw something: a panel left empty is a blind spot on the run.

Grafana itself is not run (it cannot be installed here); what it sends Prometheus is."""

from __future__ import annotations

import re
import time
import urllib.parse

from prometheus_fixtures import Prometheus, start_prometheus, stop_prometheus

from rlft.operator.metrics import OperatorMetrics
from rlft.trainer.config.telemetry import TelemetrySpec
from rlft.trainer.rollout.server import start_server
from rlft.trainer.telemetry.dashboard import dashboard
from rlft.trainer.telemetry.hub import Telemetry

JOBS = ("rlft-trainer", "rlft-rollout", "rlft-operator")
_LABEL_VALUES = re.compile(r"^label_values\((.*), (\w+)\)$")


def _resolve(server: Prometheus, variables: list[dict]) -> dict[str, str]:
    """Each query variable's "All" value, in the dashboard's order (a later variable's
    selector may use an earlier one), as Grafana's Prometheus data source gets it."""
    values: dict[str, str] = {}
    for variable in variables:
        if variable["type"] != "query":
            continue
        selector, label = _LABEL_VALUES.match(variable["query"]).groups()
        for name, value in values.items():
            selector = selector.replace(f"${name}", value)
        found = server.api(f"label/{label}/values", **{"match[]": selector})
        assert found, f"variable {variable['name']}: {selector} selects nothing"
        escaped = "|".join(_grafana_escape(v) for v in found)
        values[variable["name"]] = variable.get("allValue") or f"({escaped})"
    return values


def _grafana_escape(value: str) -> str:
    """A value in a multi-value regex, as Grafana's Prometheus data source escapes it
    (a regex escape, its backslash doubled for the PromQL string)."""
    return "".join(f"\\\\{c}" if c in "$^*{}[]'+?.()|" else c for c in value)


def _panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def _metric_of(expr: str) -> str:
    return re.search(r"\b(rlft_\w+?)(?:_bucket)?\{", expr).group(1)


def test_every_panel_of_an_exported_series_draws_it(tmp_path):
    telemetry = Telemetry.start(TelemetrySpec())
    rollout = start_server("transformers")
    rollout.serve_in_background("rollout-under-test")
    operator = OperatorMetrics()
    server = None
    try:
        telemetry.set_phase("training")
        # A run past its warm start and first checkpoint: the Unix-time gauges are drawn
        # as ages, and a 0 ("not yet") as none.
        telemetry.exporter.main_phase_began()
        telemetry.checkpoint(1, "file:///ckpt/step-000001", True)
        telemetry.record({"step": 1, "policy_version": 1, "loss": 0.1, "grad_norm": 1.0})
        rollout.metrics.request("ok")
        operator_port = operator.serve("127.0.0.1", 0)
        operator.restarts.labels(rlfinetune="job-a").inc()
        targets = {
            "rlft-trainer": f"127.0.0.1:{telemetry.server.port}",
            "rlft-rollout": f"127.0.0.1:{rollout.server_address[1]}",
            "rlft-operator": f"127.0.0.1:{operator_port}",
        }
        server = start_prometheus(
            tmp_path,
            [],
            [],
            [{"job_name": job, "static_configs": [{"targets": [targets[job]]}]} for job in JOBS],
        )

        def every_source_scraped_twice() -> bool:
            # two samples of each: a panel's rate() needs them
            counts = server.query("count_over_time(up[1m]) >= 2 and up == 1")
            return {r["metric"]["job"] for r in counts} == set(JOBS)

        server.wait_for("two scrapes of every source", every_source_scraped_twice)
        time.sleep(1)  # one scrape more: the newest samples of every series are in
        exported = {r["metric"]["__name__"] for r in server.query('{__name__=~"rlft_.*"}')}
        assert {"rlft_train_step", "rlft_rollout_requests_total", "rlft_restarts_total"} <= (
            exported
        )

        board = dashboard()
        values = _resolve(server, board["templating"]["list"])
        empty = []
        for panel in _panels(board):
            for target in panel["targets"]:
                expr = target["expr"]
                if not {_metric_of(expr), f"{_metric_of(expr)}_bucket"} & exported:
                    continue  # a series none of these sources has made yet
                for name, value in values.items():
                    expr = expr.replace(f"${name}", value)
                if not server.query(expr):
                    empty.append(f"{panel['title']}: {urllib.parse.unquote(expr)}")
        assert not empty, "panels with no data for series Prometheus holds:\n" + "\n".join(empty)
    finally:
        if server is not None:
            stop_prometheus(server)
        operator.close()
        rollout.shutdown()
        rollout.server_close()
        telemetry.close()
