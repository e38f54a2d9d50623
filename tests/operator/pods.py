"""Raw pod objects in the states the kubelet and the control plane put them in."""

from __future__ import annotations

import itertools
from typing import Any

from rlft.operator import names as N
from rlft.operator.observe import PodView, pod_view
from rlft.trainer import termination
from rlft.trainer.api_token import TOKEN_ENV

_uids = itertools.count(1)


def raw_pod(
    name: str,
    role: str = N.ROLE_TRAINER,
    index: int = 0,
    *,
    phase: str = "Pending",
    scheduled: bool = False,
    scheduled_at: str | None = None,
    exit_code: int | None = None,
    terminated_reason: str = "",
    message: str = "",
    pod_reason: str = "",
    pod_message: str = "",
    waiting: str = "",
    disruption: str = "",
    uid: str | None = None,
    created: str = "2026-01-01T00:00:00Z",
    deleting: bool = False,
    grace_ends: str | None = None,
    pod_ip: str | None = None,
    verdict: termination.Verdict | None = None,
    ready: bool | None = None,
    finished_at: str | None = None,
    rollout_token: bool = True,
) -> dict[str, Any]:
    """`verdict`: what the container's process wrote to its termination message (the
    message is then that, as the kubelet reports it, not `message`). `rollout_token`:
    the main container is given the job's rollout token (False: a pod an operator from
    before tokens made)."""
    if verdict is not None:
        message = termination.encode(verdict)
    status: dict[str, Any] = {"phase": phase, "conditions": []}
    if scheduled or phase in ("Running", "Succeeded", "Failed"):
        placed = {"type": "PodScheduled", "status": "True"}
        status["conditions"].append(
            placed | ({"lastTransitionTime": scheduled_at} if scheduled_at else {})
        )
    elif phase == "Pending":
        status["conditions"].append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }
        )
    if ready is not None:
        status["conditions"].append({"type": "Ready", "status": "True" if ready else "False"})
    if pod_reason:
        status["reason"] = pod_reason
    if pod_message:
        status["message"] = pod_message
    if disruption:
        # Kueue marks the pods of a workload it stops with a condition of its own.
        kind, _, reason = disruption.rpartition("/")
        status["conditions"].append(
            {"type": kind or "DisruptionTarget", "status": "True", "reason": reason}
        )
    state: dict[str, Any] = {}
    if exit_code is not None:
        state["terminated"] = {
            "exitCode": exit_code,
            "reason": terminated_reason or "Error",
            "message": message,
        } | ({"finishedAt": finished_at} if finished_at else {})
    elif waiting:
        state["waiting"] = {"reason": waiting, "message": f"{waiting} for image"}
    elif phase == "Running":
        state["running"] = {"startedAt": created}
    if state:
        status["containerStatuses"] = [
            {
                "name": "main",
                "state": state,
                "ready": False,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
            }
        ]
    if pod_ip:
        status["podIP"] = pod_ip
    meta: dict[str, Any] = {
        "name": name,
        "uid": uid or f"uid-{next(_uids)}",
        "creationTimestamp": created,
        "labels": {**N.labels("tiny-grpo", role, index)},
    }
    if deleting:  # the API server sets it to when the grace period ends
        meta["deletionTimestamp"] = grace_ends or created
    env = [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "t", "key": "token"}}}]
    spec = {"containers": [{"name": "main", "image": "x", "env": env if rollout_token else []}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def view(*args: Any, **kwargs: Any) -> PodView:
    result = pod_view(raw_pod(*args, **kwargs))
    assert result is not None
    return result
