"""The test cluster's scheduler: binds each pending pod to a Ready node with room for its
requests (cpu, memory, nvidia.com/gpu, any other resource the node advertises), whose
labels match its nodeSelector and whose taints it tolerates; the least loaded such node
wins. A pod that fits nowhere gets PodScheduled=False, reason Unschedulable, with the
count of nodes and why, as kube-scheduler reports it. No affinity, preemption or gangs.
The same process runs the node lifecycle controller and taint manager
(node_lifecycle.py): lost nodes are marked and their pods evicted.

    python tests/cluster/scheduler.py --api URL
"""

from __future__ import annotations

import argparse
import calendar
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_resources import pod_requests, quantity
from kube_api import Api, ApiError
from node_lifecycle import watch_nodes

NODE_LOST_S = 10.0
"""A node whose last heartbeat is older than this takes no new pods."""


def _ready(node: dict[str, Any], now: float) -> bool:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            beat = condition.get("lastHeartbeatTime")
            if beat is None:
                return True
            seen = calendar.timegm(time.strptime(beat, "%Y-%m-%dT%H:%M:%SZ"))
            return now - seen <= NODE_LOST_S
    return False


def _tolerates(pod: dict[str, Any], taint: dict[str, str]) -> bool:
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for toleration in pod["spec"].get("tolerations") or []:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        if toleration.get("operator") == "Exists" and toleration.get("key") in (None, taint["key"]):
            return True
        if toleration.get("key") == taint["key"] and toleration.get("value") == taint.get("value"):
            return True
    return False


def why_not(pod: dict[str, Any], node: dict[str, Any], used: dict[str, float]) -> str | None:
    """None when `pod` fits `node`, else kube-scheduler's short reason."""
    labels = node["metadata"].get("labels") or {}
    selector = pod["spec"].get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return "node(s) didn't match Pod's node affinity/selector"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if not _tolerates(pod, taint):
            return f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    for resource, asked in pod_requests(pod).items():
        have = quantity(allocatable.get(resource, 0)) - used.get(resource, 0.0)
        if asked > have + 1e-9:
            return f"Insufficient {resource}"
    return None


def schedule_once(api: Api, reported: dict[str, str]) -> None:
    now = time.time()
    nodes = [n for n in api.list("nodes") if _ready(n, now)]
    pods = api.list("pods")
    used: dict[str, dict[str, float]] = {n["metadata"]["name"]: {} for n in nodes}
    for pod in pods:
        name = pod["spec"].get("nodeName")
        if name in used and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            for resource, amount in pod_requests(pod).items():
                used[name][resource] = used[name].get(resource, 0.0) + amount
            used[name]["pods"] = used[name].get("pods", 0.0) + 1
    pending = [
        p
        for p in pods
        if not p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    ]
    for pod in sorted(pending, key=lambda p: p["metadata"].get("creationTimestamp", "")):
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        reasons: dict[str, int] = {}
        fits = []
        for node in nodes:
            node_name = node["metadata"]["name"]
            reason = why_not(pod, node, used[node_name])
            if reason is None:
                cpu = quantity(node["status"]["allocatable"].get("cpu", 0))
                load = used[node_name].get("cpu", 0.0) / max(cpu, 1e-9)
                fits.append((load, used[node_name].get("pods", 0.0), node_name))
            else:
                reasons[reason] = reasons.get(reason, 0) + 1
        if fits:
            chosen = min(fits)[-1]
            api.patch("pods", ns, name, {"spec": {"nodeName": chosen}})
            used[chosen]["pods"] = used[chosen].get("pods", 0.0) + 1
            for resource, amount in pod_requests(pod).items():
                used[chosen][resource] = used[chosen].get(resource, 0.0) + amount
            reported.pop(pod["metadata"]["uid"], None)
            continue
        detail = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
        message = f"0/{len(nodes)} nodes are available" + (f": {detail}." if detail else ".")
        if reported.get(pod["metadata"]["uid"]) != message:
            condition = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
            }
            status = {"phase": "Pending", "conditions": [condition]}
            api.patch("pods", ns, name, {"status": status}, status=True)
            reported[pod["metadata"]["uid"]] = message


def main() -> None:
    parser = argparse.ArgumentParser(description="the test cluster's scheduler")
    parser.add_argument("--api", required=True)
    args = parser.parse_args()
    api, reported = Api(args.api), {}
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    watched = 0.0
    while not stopping:
        try:
            schedule_once(api, reported)
            if time.time() - watched >= 1.0:
                watched = time.time()
                watch_nodes(api, watched)
        except (ApiError, OSError) as error:
            print(f"scheduler: {error}", file=sys.stderr, flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
