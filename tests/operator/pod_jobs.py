"""A job using every field of a role's own pod settings (`spec.<role>.pod`) and extended
resources, for the planner, CRD, plan and config tests."""

from __future__ import annotations

import copy
from typing import Any

from jobs import job_doc

TRAINER_POD: dict[str, Any] = {
    "volumes": [
        {"name": "model", "persistentVolumeClaim": {"claimName": "qwen3-weights"}},
        {"name": "cache", "persistentVolumeClaim": {"claimName": "rlft-cache", "readOnly": False}},
        {"name": "staging", "emptyDir": {"sizeLimit": "200Gi"}},
        {"name": "ramdisk", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "prompts", "configMap": {"name": "prompt-templates"}},
        {"name": "hf-token", "secret": {"secretName": "hf-token"}},
    ],
    "volumeMounts": [
        {"name": "model", "mountPath": "/models"},
        {"name": "model", "mountPath": "/data", "subPath": "datasets/math"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "staging", "mountPath": "/staging"},
        {"name": "ramdisk", "mountPath": "/ramdisk"},
        {"name": "prompts", "mountPath": "/etc/prompts"},
        {"name": "hf-token", "mountPath": "/var/run/hf", "readOnly": True},
    ],
    "envFrom": [
        {"configMapRef": {"name": "nccl-settings"}},
        {"secretRef": {"name": "wandb", "optional": True}, "prefix": "WANDB_"},
    ],
    "imagePullSecrets": [{"name": "registry-credentials"}],
    "serviceAccountName": "rlft-s3",
    "automountServiceAccountToken": True,
    "runtimeClassName": "nvidia",
    "labels": {"team": "post-training", "example.com/cost-center": "ml-42"},
    "annotations": {
        "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
        "k8s.v1.cni.cncf.io/networks": "rdma-net",
    },
    "capabilities": ["IPC_LOCK"],
}
ROLLOUT_POD: dict[str, Any] = {
    "volumes": [
        {"name": "model", "persistentVolumeClaim": {"claimName": "qwen3-weights"}},
        {"name": "compile-cache", "emptyDir": {}},
    ],
    "volumeMounts": [
        {"name": "model", "mountPath": "/models"},
        {"name": "compile-cache", "mountPath": "/cache"},
    ],
    "envFrom": [{"secretRef": {"name": "hf-token"}}],
    "imagePullSecrets": [{"name": "registry-credentials"}],
    "serviceAccountName": "rlft-rollout",
    "runtimeClassName": "nvidia",
    "labels": {"team": "post-training", "serving": "vllm"},
    "annotations": {"example.com/owner": "rl-team"},
}
EXTENDED = {"rdma/hca_shared_devices_a": 1}


def every_pod_setting(name: str = "pods", multi_node: bool = True) -> dict[str, Any]:
    """The tiny example with every pod setting for both roles; with `multi_node`, rollout
    instances spanning two nodes, so that Ray heads and workers are planned too."""
    rollout: dict[str, Any] = {
        "pod": copy.deepcopy(ROLLOUT_POD),
        "resources": {"extended": dict(EXTENDED)},
    }
    if multi_node:
        rollout.update(engine="vllm", instances=2, gpusPerInstance=4, nodesPerInstance=2)
    doc = job_doc(
        name=name,
        trainer={
            "pod": copy.deepcopy(TRAINER_POD),
            "gpusPerPod": 2,
            "resources": {"requests": {"cpu": "8"}, "extended": dict(EXTENDED)},
        },
        rollout=rollout,
    )
    doc["spec"]["model"] = {"path": "/models/qwen3"}  # the model on the mounted claim
    return doc
