"""The part of kube-controller-manager that notices lost nodes, emulated for the test
cluster (run in the scheduler's process, once a second):

- the node lifecycle controller: a node whose kubelet has not posted status for
  NODE_GRACE_S gets Ready=Unknown (NodeStatusUnknown) and the taint
  `node.kubernetes.io/unreachable:NoExecute`, and its pods get Ready=False (what
  MarkPodsNotReady does: their kubelet cannot say); a node that reports again loses the
  taint (its kubelet sets Ready=True itself, and its pods' readiness);
- the taint manager: a pod on a node with a NoExecute taint is evicted at once if it
  does not tolerate the taint, `tolerationSeconds` after the taint was added if it does
  for that long, never if it does for ever. A pod without a toleration of its own for
  the unreachable taint gets 300 s, as the DefaultTolerationSeconds admission plugin
  gives it. Eviction is what Kubernetes does: the DisruptionTarget condition (reason
  DeletionByTaintManager), then a graceful delete, which, with no kubelet to finish
  it, leaves the pod Terminating.

Real clusters wait 40 s (node-monitor-grace-period) before a node is Unknown; the test
cluster waits NODE_GRACE_S.
"""

from __future__ import annotations

import calendar
import time
from typing import Any

from kube_api import Api

NODE_GRACE_S = 10.0
UNREACHABLE = "node.kubernetes.io/unreachable"
DEFAULT_TOLERATION_S = 300


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _seconds(stamp: str) -> float:
    return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))


def _ready(node: dict[str, Any]) -> dict[str, Any] | None:
    conditions = (node.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == "Ready"), None)


def watch_nodes(api: Api, now: float) -> None:
    """One pass of the node lifecycle controller, then of the taint manager."""
    for node in api.list("nodes"):
        name = node["metadata"]["name"]
        ready = _ready(node)
        taints = (node.get("spec") or {}).get("taints") or []
        tainted = any(t.get("key") == UNREACHABLE for t in taints)
        beat = (ready or {}).get("lastHeartbeatTime")
        silent = beat is not None and now - _seconds(beat) > NODE_GRACE_S
        if silent and ready.get("status") != "Unknown":
            lost = dict(ready, status="Unknown", reason="NodeStatusUnknown")
            lost |= {"message": "Kubelet stopped posting node status.",
                     "lastTransitionTime": _stamp(now)}  # fmt: skip
            api.patch("nodes", None, name, {"status": {"conditions": [lost]}}, status=True)
            mark_pods_not_ready(api, name, now)
        if silent and not tainted:
            taint = {"key": UNREACHABLE, "effect": "NoExecute", "timeAdded": _stamp(now)}
            api.patch("nodes", None, name, {"spec": {"taints": [*taints, taint]}})
        elif not silent and tainted:
            kept = [t for t in taints if t.get("key") != UNREACHABLE]
            api.patch("nodes", None, name, {"spec": {"taints": kept or None}})
    evict_untolerated(api, now)


def mark_pods_not_ready(api: Api, node: str, now: float) -> None:
    for pod in api.list("pods"):
        if pod["spec"].get("nodeName") != node:
            continue
        conditions = (pod.get("status") or {}).get("conditions") or []
        if not any(c.get("type") == "Ready" and c.get("status") != "False" for c in conditions):
            continue
        marked = [
            dict(c, status="False", lastTransitionTime=_stamp(now)) if c.get("type") == "Ready"
            else c
            for c in conditions
        ]  # fmt: skip
        meta = pod["metadata"]
        patch = {"status": {"conditions": marked}}
        api.patch("pods", meta["namespace"], meta["name"], patch, status=True)


def evict_untolerated(api: Api, now: float) -> None:
    lost = {}
    for node in api.list("nodes"):
        for taint in (node.get("spec") or {}).get("taints") or []:
            if taint.get("key") == UNREACHABLE and taint.get("effect") == "NoExecute":
                lost[node["metadata"]["name"]] = _seconds(taint["timeAdded"])
    for pod in api.list("pods"):
        node, meta = pod["spec"].get("nodeName"), pod["metadata"]
        if node not in lost or meta.get("deletionTimestamp"):
            continue
        allowed = _toleration_seconds(pod)
        if allowed is None or now - lost[node] < allowed:
            continue
        conditions = [
            c for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") != "DisruptionTarget"
        ]  # fmt: skip
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "DeletionByTaintManager",
                "message": "Taint manager: deleting due to NoExecute taint",
                "lastTransitionTime": _stamp(now),
            }
        )
        namespace, name = meta["namespace"], meta["name"]
        api.patch("pods", namespace, name, {"status": {"conditions": conditions}}, status=True)
        api.delete("pods", namespace, name)


def _toleration_seconds(pod: dict[str, Any]) -> float | None:
    """Seconds the pod may stay on an unreachable node; None: for ever."""
    for toleration in pod["spec"].get("tolerations") or []:
        key, effect = toleration.get("key"), toleration.get("effect")
        matches = key == UNREACHABLE or (key is None and toleration.get("operator") == "Exists")
        if matches and effect in (None, "", "NoExecute"):
            seconds = toleration.get("tolerationSeconds")
            return None if seconds is None else float(seconds)
    return DEFAULT_TOLERATION_S
