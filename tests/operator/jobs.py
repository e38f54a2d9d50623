"""Job documents for the operator tests, built from the example the README runs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rlft.trainer.config import RLFineTune, parse_job, read_yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-grpo.yaml"
CLUSTER_URI = "s3://rlft-test"
"""Jobs on Kubernetes need an object-store location (the CRD refuses any other)."""


def example() -> dict[str, Any]:
    return read_yaml(EXAMPLE.read_text())


def on_cluster(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with an s3:// checkpoint location if it has none (what a user adds to the
    examples before `kubectl apply`)."""
    doc = copy.deepcopy(doc)
    checkpoint = doc["spec"].setdefault("checkpoint", {})
    checkpoint.setdefault("uri", f"{CLUSTER_URI}/{doc.get('metadata', {}).get('name', 'job')}")
    return doc


def job_doc(name: str = "tiny-grpo", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    """The example with `spec` sections merged in (one level deep per section), and an
    s3:// checkpoint location unless `checkpoint` names one."""
    doc = example()
    doc["metadata"] = {"name": name, "namespace": namespace}
    for section, values in spec.items():
        if isinstance(values, dict) and isinstance(doc["spec"].get(section), dict):
            doc["spec"][section] = {**doc["spec"][section], **copy.deepcopy(values)}
        else:
            doc["spec"][section] = copy.deepcopy(values)
    return on_cluster(doc)


def parsed(doc: dict[str, Any]) -> tuple[RLFineTune, dict[str, Any]]:
    """The pydantic job and a raw body with server-side metadata, as the operator sees it."""
    body = copy.deepcopy(doc)
    body["metadata"] = {
        **doc["metadata"],
        "uid": "0f0e-uid",
        "generation": 1,
        "resourceVersion": "7",
    }
    return parse_job(doc), body
