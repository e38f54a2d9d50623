"""Rendering the chart with Helm's own library (helm-python-sdk: Helm 4's Go code, no binary)
and validating what comes out: `kubernetes-validate --strict` for built-in kinds, the
prometheus-operator models (cloudcoil) for ServiceMonitor, PodMonitor and PrometheusRule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rlft"
RELEASE = "rlft"
NAMESPACE = "rlft-system"

# Every optional part turned on.
ALL_TOGGLES: dict[str, Any] = {
    "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
    "jobMetrics": {"podMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
    "grafanaDashboard": {"enabled": True, "namespace": "monitoring"},
    "networkPolicy": {
        "enabled": True,
        "apiServer": {"cidrs": ["10.0.0.1/32"]},
        "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
    },
    "podDisruptionBudget": {"enabled": True},
}
NAMESPACED = {"watchNamespaces": ["ml", "research"]}
MONITORING_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")


def load() -> helm.Chart:
    return helm.Chart.load(CHART)


def render(
    chart: helm.Chart, values: dict[str, Any] | None = None, namespace: str = NAMESPACE
) -> tuple[list[dict[str, Any]], str]:
    """(every rendered object, NOTES.txt)."""
    out = chart.render(values or {}, name=RELEASE, namespace=namespace)
    documents: list[dict[str, Any]] = []
    notes = ""
    for template, text in sorted(out.items()):
        if template.endswith("NOTES.txt"):
            notes = text
            continue
        for document in yaml.safe_load_all(text):
            if document:
                documents.append(document)
    return documents, notes


def of_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in documents if d["kind"] == kind]


def kubernetes_validate(documents: list[dict[str, Any]], tmp_path: Path) -> str:
    """`kubernetes-validate --strict` over the built-in kinds; returns its output, fails on
    any error."""
    builtin = [d for d in documents if d["kind"] not in MONITORING_KINDS]
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(builtin))
    tool = str(Path(sys.executable).parent / "kubernetes-validate")
    result = subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("passed") == len(builtin), output
    return output


def _unknown_fields(given: Any, kept: Any, where: str) -> list[str]:
    """Paths in `given` that a model dump (`kept`) dropped: fields the schema lacks."""
    if isinstance(given, dict):
        kept = kept if isinstance(kept, dict) else {}
        out = []
        for key, value in given.items():
            if key not in kept:
                out.append(f"{where}.{key}")
            else:
                out += _unknown_fields(value, kept[key], f"{where}.{key}")
        return out
    if isinstance(given, list):
        kept = kept if isinstance(kept, list) else []
        out = []
        for i, value in enumerate(given):
            out += _unknown_fields(value, kept[i] if i < len(kept) else None, f"{where}[{i}]")
        return out
    return []


def monitoring_problems(document: dict[str, Any]) -> list[str]:
    """Problems of a prometheus-operator object against its upstream API (the cloudcoil
    models are generated from prometheus-operator's CRDs): type errors, and unknown fields,
    which the models would silently drop."""
    from cloudcoil.models.prometheus_operator import v1
    from pydantic import ValidationError

    model = getattr(v1, document["kind"])
    try:
        parsed = model.model_validate(document)
    except ValidationError as error:
        return [str(error)]
    kept = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return [f"unknown field {path}" for path in _unknown_fields(document, kept, document["kind"])]
