"""The job files of examples/, parsed as the operator sees them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from rlft.trainer.config import RLFineTune, parse_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def document(path: Path) -> dict[str, Any]:
    """The one RLFineTune in an example file."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(documents) == 1, f"{path.name}: one RLFineTune per file"
    return documents[0]


def parsed_examples(multi_node_rollout: bool = False) -> list[tuple[RLFineTune, dict[str, Any]]]:
    """(job, body with server-side metadata) of every example; with `multi_node_rollout`,
    also the GPU example with rollout instances spanning two nodes (Ray)."""
    documents = {path.name: document(path) for path in EXAMPLES}
    if multi_node_rollout:
        wide = copy.deepcopy(documents["qwen3-moe-vllm-gpu.yaml"])
        wide["metadata"]["name"] = "wide"
        wide["spec"]["rollout"].update(nodesPerInstance=2, gpusPerInstance=16)
        documents["wide"] = wide
    out = []
    for name, doc in documents.items():
        body = copy.deepcopy(doc)
        body["metadata"] = {**doc["metadata"], "namespace": "ml", "uid": f"uid-{name}"}
        out.append((parse_job(doc, name), body))
    return out
