"""The emulated API server's ResourceQuota admission (quota.py) refuses creates with the
messages kube-apiserver's ResourceQuota plugin writes."""

from __future__ import annotations

from typing import Any

import quota


def _pod(name: str, phase: str = "Running", **resources: Any) -> dict[str, Any]:
    container = {"name": "main", "resources": resources} if resources else {"name": "main"}
    return {
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container]},
        "status": {"phase": phase},
    }


def _quota(name: str, **hard: str) -> dict[str, Any]:
    return {"kind": "ResourceQuota", "metadata": {"name": name}, "spec": {"hard": hard}}


def test_a_pod_over_the_pod_count_is_refused_with_the_api_servers_message():
    existing = [_pod("a"), _pod("b"), _pod("done", phase="Succeeded")]
    message = quota.refusal(_pod("c"), "pods", [_quota("q", pods="2")], existing)
    assert message == "exceeded quota: q, requested: pods=1, used: pods=2, limited: pods=2"
    assert quota.refusal(_pod("c"), "pods", [_quota("q", pods="3")], existing) is None


def test_compute_and_extended_resources_are_summed_requests_defaulting_to_limits():
    gpus = {"limits": {"nvidia.com/gpu": 8, "cpu": "4", "memory": "16Gi"}}
    existing = [_pod("a", **gpus)]
    hard = _quota("gpu", **{"requests.nvidia.com/gpu": "8", "requests.memory": "64Gi"})
    message = quota.refusal(_pod("b", **gpus), "pods", [hard], existing)
    assert message == (
        "exceeded quota: gpu, requested: requests.nvidia.com/gpu=8, "
        "used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8"
    )
    half = {"requests": {"cpu": "500m"}, "limits": {"cpu": "1"}}
    assert (
        quota.refusal(_pod("c", **half), "pods", [_quota("c", cpu="1")], [_pod("x", **half)])
        is None
    )


def test_a_pod_that_does_not_state_a_constrained_resource_is_refused():
    message = quota.refusal(_pod("a"), "pods", [_quota("q", **{"limits.memory": "1Gi"})], [])
    assert message == "failed quota: q: must specify limits.memory"
