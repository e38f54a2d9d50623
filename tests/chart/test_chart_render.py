"""The Helm chart rendered with Helm's own library: generated files fresh, lint clean, every
manifest valid (kubernetes-validate --strict; prometheus-operator's API for the monitoring
kinds; promtool for the alert rules), bad values rejected naming the field."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from chart_render import (
    ALL_TOGGLES,
    CHART,
    NAMESPACE,
    NAMESPACED,
    ROOT,
    kubernetes_validate,
    monitoring_problems,
    of_kind,
    render,
)

from rlft.operator import chart_files
from rlft.operator.__main__ import pod_settings
from rlft.operator.chart_values import ChartValues
from rlft.operator.options import build_parser

CASES = {
    "defaults": {},
    "all-toggles": ALL_TOGGLES,
    "namespaced-all-toggles": {**ALL_TOGGLES, **NAMESPACED},
}


def test_generated_files_are_fresh():
    stale = chart_files.stale()
    assert stale == [], f"stale chart files {stale}: run `{chart_files.COMMAND}`"


def test_generator_check_flags_a_stale_file(tmp_path):
    copy_of_chart = tmp_path / "rlft"
    shutil.copytree(CHART, copy_of_chart)
    assert chart_files.stale(copy_of_chart) == []
    (copy_of_chart / "values.yaml").write_text("replicas: 1\n")
    (copy_of_chart / "files" / "rules" / "old.yaml").write_text("groups: []\n")
    assert sorted(chart_files.stale(copy_of_chart)) == ["files/rules/old.yaml", "values.yaml"]
    chart_files.write(copy_of_chart)
    assert chart_files.stale(copy_of_chart) == []


def test_chart_metadata_and_crds(chart):
    assert chart.metadata["appVersion"] == chart_files.package_version()
    assert chart.metadata["name"] == "rlft"
    # What Helm installs from crds/ is byte-identical to the repository's CRDs.
    installed = {Path(c["filename"]).name: c["data"] for c in chart.crds}
    assert installed == {
        "rlfinetune.yaml": (ROOT / "crds" / "rlfinetune.yaml").read_text(),
        "kopf-peering.yaml": (ROOT / "crds" / "kopf-peering.yaml").read_text(),
    }


def test_default_values_are_the_models_defaults(chart):
    assert chart.values == ChartValues().model_dump(mode="json", by_alias=True)
    assert chart.schema is not None and chart.schema["additionalProperties"] is False


@pytest.mark.parametrize("case", CASES)
def test_good_values_pass_the_schema_and_the_models(chart, case):
    chart.validate_schema(CASES[case])
    ChartValues.model_validate(CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_lint_reports_nothing_above_info(case):
    report = helm.lint(CHART, CASES[case], strict=True, namespace=NAMESPACE)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_manifest_is_valid(chart, case, tmp_path):
    documents, _ = render(chart, CASES[case])
    kinds = sorted(d["kind"] for d in documents)
    output = kubernetes_validate(documents, tmp_path)
    assert "Couldn't find schema" not in output  # every built-in kind really checked
    for document in documents:
        if document["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
            assert monitoring_problems(document) == [], document["metadata"]["name"]
    expected = ["ClusterRole", "ClusterRoleBinding", "Deployment", "PodDisruptionBudget"]
    expected += ["Service", "ServiceAccount"]
    if case != "defaults":
        expected += ["ConfigMap", "NetworkPolicy", "PodMonitor", "PodMonitor"]
        expected += ["PrometheusRule", "ServiceMonitor"]
    if case.startswith("namespaced"):
        expected += ["Role", "Role", "RoleBinding", "RoleBinding"]
    assert kinds == sorted(expected)


def test_monitoring_check_is_real(chart):
    documents, _ = render(chart, ALL_TOGGLES)
    monitor = copy.deepcopy(of_kind(documents, "ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    assert monitoring_problems(monitor) == [
        "unknown field ServiceMonitor.spec.endpoints[0].intervall"
    ]
    monitor = copy.deepcopy(of_kind(documents, "PodMonitor")[0])
    monitor["spec"]["podMetricsEndpoints"] = "metrics"
    assert monitoring_problems(monitor)


def test_operator_arguments_are_the_operators_own_options(chart):
    """The Deployment's args parse with the operator's real argument parser, and mean what
    the values say."""
    values = {
        "watchNamespaces": ["ml", "research"],
        "operator": {"pollSeconds": 5, "verbose": True, "jobNetworkPolicy": False},
    }
    for given, all_namespaces, namespaces in (({}, True, []), (values, False, ["ml", "research"])):
        documents, _ = render(chart, given)
        container = of_kind(documents, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
        args = build_parser().parse_args(container["args"])
        assert args.all_namespaces is all_namespaces and args.namespace == namespaces
        assert pod_settings(args).network_policy is (given == {})  # on unless turned off
        assert args.peering == "rlft" and not args.standalone  # leader election on
        port = int(args.metrics_bind.rpartition(":")[2])
        assert container["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
        # paths the operator serves (tests/operator/test_operator_in_process.py): /livez
        # from its event loop's heartbeat, not /metrics, which a thread of its own answers
        for probe, path in (
            ("startupProbe", "/metrics"),
            ("livenessProbe", "/livez"),
            ("readinessProbe", "/metrics"),
        ):
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}
    assert args.poll_seconds == 5 and args.verbose
    assert {e["name"] for e in container["env"]} >= {"POD_NAME", "POD_NAMESPACE"}


def test_two_replicas_with_a_disruption_budget(chart):
    documents, _ = render(chart)
    deployment = of_kind(documents, "Deployment")[0]
    assert deployment["spec"]["replicas"] == 2
    budget = of_kind(documents, "PodDisruptionBudget")[0]
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert "podAntiAffinity" in deployment["spec"]["template"]["spec"]["affinity"]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"ghcr.io/rlft/operator:{chart_files.package_version()}"
    digest = "sha256:" + "ab" * 32
    documents, _ = render(chart, {"image": {"digest": digest}})
    image = of_kind(documents, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert image["image"] == f"ghcr.io/rlft/operator@{digest}"


def test_prometheus_rule_and_dashboard_are_the_observability_files(chart, tmp_path):
    documents, _ = render(chart, ALL_TOGGLES)
    rule = of_kind(documents, "PrometheusRule")[0]
    source = yaml.safe_load((ROOT / "observability" / "rules" / "rlft-alerts.yaml").read_text())
    assert rule["spec"] == source and rule["metadata"]["labels"]["release"] == "prom"
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: run `make setup` (installs Debian's prometheus)"
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    (dashboard,) = of_kind(documents, "ConfigMap")
    assert dashboard["metadata"]["namespace"] == "monitoring"
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = json.loads((ROOT / "observability" / "grafana" / "rlft.json").read_text())
    assert json.loads(dashboard["data"]["rlft.json"]) == source


def test_network_policy_allows_only_what_the_operator_needs(chart):
    documents, _ = render(chart, {**ALL_TOGGLES, **NAMESPACED})
    (policy,) = of_kind(documents, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert [p["port"] for rule in spec["ingress"] for p in rule["ports"]] == ["metrics"]
    egress_ports = sorted(p["port"] for rule in spec["egress"] for p in rule["ports"])
    assert egress_ports == [53, 53, 443, 6443, 8080]
    api_rule = spec["egress"][1]
    assert api_rule["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    trainers = spec["egress"][2]["to"][0]
    assert trainers["podSelector"]["matchLabels"]["rlft.dev/role"] == "trainer"
    assert trainers["namespaceSelector"]["matchExpressions"][0]["values"] == ["ml", "research"]


def test_notes_say_what_to_do_next(chart):
    _, notes = render(chart, NAMESPACED)
    assert "serving RLFineTunes in ml, research" in notes
    assert "kubectl -n ml create secret generic rlft-s3-credentials" in notes
    assert "kubectl -n ml apply -f examples/s3-checkpoints.yaml" in notes
    assert "kubectl get rlft" in notes and "suspend" in notes
    _, notes = render(chart)
    assert "all namespaces" in notes and "jobMetrics.podMonitor.enabled" in notes
    assert "kubectl -n default apply -f examples/s3-checkpoints.yaml" in notes


BAD_VALUES = [
    ({"replicas": 0}, "/replicas"),
    ({"watchNamespaces": ["Bad_Namespace"]}, "/watchNamespaces/0"),
    ({"watchNamespaces": ["ml", "ml"]}, "/watchNamespaces"),
    ({"operator": {"pollSecond": 5}}, "'pollSecond' not allowed"),
    ({"operator": {"metricsPort": 80}}, "/operator/metricsPort"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
    ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "/metrics/serviceMonitor/interval"),
    ({"networkPolicy": {"enabled": "yes"}}, "/networkPolicy/enabled"),
    ({"replica": 2}, "'replica' not allowed"),
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES)
def test_bad_values_are_rejected_naming_the_field(chart, values, field):
    with pytest.raises(helm.HelmValuesError) as error:
        chart.render(values, name="rlft", namespace=NAMESPACE)
    assert field in str(error.value), str(error.value)
    # The pydantic models, the schema's source, reject the same values.
    with pytest.raises(ValueError):
        ChartValues.model_validate(values)


def test_a_bad_values_file_is_rejected(chart, tmp_path):
    text = "replicas: 2\noperator:\n  peering: Not A Name\n"
    values = helm.values_from_yaml(text)
    with pytest.raises(helm.HelmValuesError, match="/operator/peering"):
        chart.render(values, name="rlft", namespace=NAMESPACE)
    report = helm.lint(CHART, values)
    assert any("/operator/peering" in e for e in report["errors"]), report


def test_job_monitor_and_network_policy_match_the_pods_the_operator_creates(chart):
    from example_jobs import parsed_examples

    from rlft.operator import manifests as M
    from rlft.operator import names as N

    pods = []
    for job, body in parsed_examples(multi_node_rollout=True):
        pods += M.desired(job, body, M.Settings(), "auto").pods.values()
    documents, _ = render(chart, {**ALL_TOGGLES, **NAMESPACED})
    (monitor,) = [
        m for m in of_kind(documents, "PodMonitor") if m["metadata"]["name"].endswith("-jobs")
    ]
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [p for p in pods if selector.items() <= p["metadata"]["labels"].items()]
    assert scraped == pods
    ports = {port["name"] for p in pods for port in p["spec"]["containers"][0].get("ports", [])}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert {e["port"] for e in endpoints} == {"status", "http"} and {"status", "http"} <= ports
    label = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9]", "_", N.LABEL_JOB)
    assert endpoints[0]["relabelings"][0]["sourceLabels"] == [label]
    (policy,) = of_kind(documents, "NetworkPolicy")
    trainers = policy["spec"]["egress"][2]
    wanted = trainers["to"][0]["podSelector"]["matchLabels"]
    selected = [p for p in pods if wanted.items() <= p["metadata"]["labels"].items()]
    assert selected and all(
        p["metadata"]["labels"][N.LABEL_ROLE] == N.ROLE_TRAINER for p in selected
    )
    assert trainers["ports"][0]["port"] == M.Settings().status_port


def _promtool_accepts_scrape(interval: str, timeout: str, tmp_path: Path) -> bool:
    """Whether Prometheus itself (promtool) takes a scrape with this interval and timeout."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: run `make setup` (installs Debian's prometheus)"
    scrape = {"job_name": "j", "scrape_interval": interval, "scrape_timeout": timeout}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump({"scrape_configs": [scrape]}))
    result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True)
    return result.returncode == 0


MONITORS = [("metrics", "serviceMonitor"), ("metrics", "podMonitor"), ("jobMetrics", "podMonitor")]
# (interval, scrapeTimeout); None: the timeout left at its default
SCRAPES = [("5s", None), ("1m", "1m30s"), ("1m30s", "1m"), ("10s", "10s"), ("1h", "500ms")]


@pytest.mark.parametrize(("section", "monitor"), MONITORS)
@pytest.mark.parametrize(("interval", "timeout"), SCRAPES)
def test_a_scrape_timeout_longer_than_its_interval_is_refused(
    chart, tmp_path, section, monitor, interval, timeout
):
    """prometheus-operator drops a monitor whose scrapeTimeout exceeds its interval (and
    Prometheus refuses such a scrape): the chart refuses exactly what Prometheus does, so
    setting only `interval: 5s` (the timeout left at its 10s default) fails at install
    instead of leaving the pods silently unscraped."""
    scrape = {"enabled": True, "interval": interval}
    if timeout is not None:
        scrape["scrapeTimeout"] = timeout
    values = {section: {monitor: scrape}}
    effective = timeout or chart.values[section][monitor]["scrapeTimeout"]
    if _promtool_accepts_scrape(interval, effective, tmp_path):
        documents, _ = render(chart, values)
        kind = "ServiceMonitor" if monitor == "serviceMonitor" else "PodMonitor"
        (rendered,) = of_kind(documents, kind)
        spec = rendered["spec"]
        endpoints = spec.get("endpoints") or spec["podMetricsEndpoints"]
        assert {(e["interval"], e["scrapeTimeout"]) for e in endpoints} == {(interval, effective)}
        ChartValues.model_validate(values)
    else:
        with pytest.raises(helm.HelmRenderError, match=f"{section}.{monitor}.scrapeTimeout"):
            render(chart, values)
        with pytest.raises(ValueError, match="scrapeTimeout"):
            ChartValues.model_validate(values)


def test_notes_say_how_to_upgrade_the_crds(chart):
    """Helm installs crds/ only on the first install and never upgrades them: the notes
    (shown by install and upgrade) name the command that applies every CRD of the chart."""
    _, notes = render(chart)
    assert "helm upgrade" in notes
    (folder,) = re.findall(r"kubectl apply -f (\S+)", notes)
    applied = {path.name: path.read_text() for path in (ROOT / folder).glob("*.yaml")}
    assert applied == {Path(c["filename"]).name: c["data"] for c in chart.crds}
