"""The test cluster's scheduler: binds each pending pod to a Ready node with room for its
requests (cpu, memory, nvidia.com/gpu, any other resource the node advertises), whose
labels match its nodeSelector and whose taints it tolerates; the least loaded such node
wins. A pod that fits nowhere gets PodScheduled=False, reason Unschedulable, with the
count of nodes and why, as kube-scheduler reports it. No affinity or preemption.

Gangs, as scheduler-plugins' Coscheduling and Volcano place them: a pod with the label
`scheduling.x-k8s.io/pod-group` (coscheduling) or the annotation
`scheduling.k8s.io/group-name` (Volcano) is bound only together with the other pending
members of its PodGroup (`scheduling.x-k8s.io/v1alpha1` or `scheduling.volcano.sh/v1beta1`,
its CRD applied to the API server), and only when at least `minMember` of them (running
members count) fit at once, and for Volcano each task's `minTaskMember` (the task being
the pod's `volcano.sh/task-spec`); otherwise none is bound, and each says why as
Unschedulable. A member whose PodGroup does not exist waits (both schedulers refuse it).
The oldest group's pods are tried first. Not emulated: Volcano's queues and enqueue
admission, `minResources` (what fits is decided on the nodes, which checks it anyway),
scheduleTimeoutSeconds, backoff of failed groups, priorities; Kueue (no admission
webhook or controller: a Kueue pod's labels are ignored and it is scheduled like any
other). Pods with scheduling gates are left alone, as kube-scheduler leaves them. This one
scheduler answers for `default-scheduler`, `volcano` and `scheduler-plugins-scheduler`;
a pod naming any other schedulerName stays pending, as it would on a cluster without it.

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
SCHEDULER_NAMES = frozenset({"default-scheduler", "volcano", "scheduler-plugins-scheduler"})
"""The schedulerNames this scheduler answers for (the default one, Volcano's, and
scheduler-plugins' as a second scheduler)."""
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
VOLCANO_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_TASK = "volcano.sh/task-spec"
POD_GROUP_APIS = ("scheduling.x-k8s.io/v1alpha1", "scheduling.volcano.sh/v1beta1")


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


Used = dict[str, dict[str, float]]
"""Per node: what its pods request, and their count under `pods`."""


def choose(pod: dict[str, Any], nodes: list[dict[str, Any]], used: Used) -> tuple[str | None, str]:
    """The least loaded node the pod fits (and ""), or None and kube-scheduler's message."""
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
        return min(fits)[-1], ""
    detail = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    return None, f"0/{len(nodes)} nodes are available" + (f": {detail}." if detail else ".")


def _take(used: Used, node: str, pod: dict[str, Any]) -> None:
    used[node]["pods"] = used[node].get("pods", 0.0) + 1
    for resource, amount in pod_requests(pod).items():
        used[node][resource] = used[node].get(resource, 0.0) + amount


def group_of(pod: dict[str, Any]) -> str | None:
    """`namespace/name` of the pod's PodGroup (coscheduling's label, Volcano's annotation)."""
    meta = pod["metadata"]
    name = (meta.get("labels") or {}).get(COSCHEDULING_LABEL) or (
        meta.get("annotations") or {}
    ).get(VOLCANO_ANNOTATION)
    return f"{meta['namespace']}/{name}" if name else None


def _active(pod: dict[str, Any]) -> bool:
    """Bound, not terminated, not being deleted: a member that holds its place."""
    phase = (pod.get("status") or {}).get("phase")
    return (
        bool(pod["spec"].get("nodeName"))
        and phase not in ("Succeeded", "Failed")
        and not pod["metadata"].get("deletionTimestamp")
    )


def _task(pod: dict[str, Any]) -> str:
    return (pod["metadata"].get("annotations") or {}).get(VOLCANO_TASK, "")


def place_gang(
    group: dict[str, Any] | None,
    members: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
    used: Used,
) -> tuple[dict[str, str], str]:
    """All or nothing: ({pending member's name: node} for every pending member that fits,
    ""), when with the running members they make `minMember` (and each Volcano task its
    `minTaskMember`), placed at once on the nodes' free room; else ({}, why not). Pure:
    `used` is not changed."""
    if group is None:
        return {}, "its PodGroup does not exist"
    spec = group.get("spec") or {}
    running = [p for p in members if _active(p)]
    pending = [
        p
        for p in members
        if not p["spec"].get("nodeName")
        and not p["metadata"].get("deletionTimestamp")
        and not p["spec"].get("schedulingGates")
    ]
    need = max(0, int(spec.get("minMember", 1)) - len(running))
    task_need = {
        task: max(0, int(count) - sum(_task(p) == task for p in running))
        for task, count in (spec.get("minTaskMember") or {}).items()
    }
    # Pods a task still needs first: spare members (elastic trainers) must not take the
    # room of those the gang cannot start without.
    wanted = dict(task_need)
    order = []
    for pod in sorted(
        pending, key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"])
    ):
        first = wanted.get(_task(pod), 0) > 0
        if first:
            wanted[_task(pod)] -= 1
        order.append((not first, pod))
    order.sort(key=lambda item: item[0])
    trial = {node: dict(amounts) for node, amounts in used.items()}
    chosen: dict[str, str] = {}
    why = ""
    for _, pod in order:
        node, reason = choose(pod, nodes, trial)
        if node is None:
            why = why or reason
            continue
        _take(trial, node, pod)
        chosen[pod["metadata"]["name"]] = node
    placed_tasks = {
        t: sum(_task(p) == t for p in pending if p["metadata"]["name"] in chosen) for t in task_need
    }
    short = [t for t, n in task_need.items() if placed_tasks[t] < n]
    if len(chosen) >= need and not short:
        return chosen, ""
    total = len(running) + len(pending)
    if total < int(spec.get("minMember", 1)):
        return {}, f"{total} of its minMember {spec.get('minMember')} pods exist"
    detail = f" (tasks short: {', '.join(sorted(short))})" if short else ""
    return {}, (
        f"{len(running) + len(chosen)} of its minMember {spec.get('minMember')} pods fit at "
        f"once{detail}; {why}".rstrip("; ")
    )


def pod_groups(api: Api) -> dict[str, dict[str, Any]]:
    """Every PodGroup by `namespace/name`, of both APIs (none where a CRD is not applied)."""
    found: dict[str, dict[str, Any]] = {}
    for api_version in POD_GROUP_APIS:
        try:
            items = api.request("GET", f"/apis/{api_version}/podgroups")["items"]
        except ApiError as error:
            if error.code == 404:
                continue
            raise
        for item in items:
            found[f"{item['metadata']['namespace']}/{item['metadata']['name']}"] = item
    return found


def _unschedulable(api: Api, pod: dict[str, Any], message: str, reported: dict[str, str]) -> None:
    if reported.get(pod["metadata"]["uid"]) == message:
        return
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": message,
    }
    status = {"phase": "Pending", "conditions": [condition]}
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    api.patch("pods", ns, name, {"status": status}, status=True)
    reported[pod["metadata"]["uid"]] = message


def schedule_once(api: Api, reported: dict[str, str]) -> None:
    now = time.time()
    nodes = [n for n in api.list("nodes") if _ready(n, now)]
    pods = api.list("pods")
    used: Used = {n["metadata"]["name"]: {} for n in nodes}
    for pod in pods:
        name = pod["spec"].get("nodeName")
        if name in used and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            _take(used, name, pod)
    pending = [
        p
        for p in pods
        if not p["spec"].get("nodeName")
        and not p["metadata"].get("deletionTimestamp")
        and not p["spec"].get("schedulingGates")  # kube-scheduler leaves gated pods alone
        and p["spec"].get("schedulerName", "default-scheduler") in SCHEDULER_NAMES
    ]
    groups = pod_groups(api) if any(group_of(p) for p in pending) else {}
    tried: set[str] = set()
    for pod in sorted(pending, key=lambda p: p["metadata"].get("creationTimestamp", "")):
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        group = group_of(pod)
        if group is not None:
            if group in tried:
                continue
            tried.add(group)
            members = [p for p in pods if group_of(p) == group]
            chosen, why = place_gang(groups.get(group), members, nodes, used)
            for member in members:
                node = chosen.get(member["metadata"]["name"])
                if node is not None:
                    api.patch("pods", ns, member["metadata"]["name"], {"spec": {"nodeName": node}})
                    _take(used, node, member)
                    reported.pop(member["metadata"]["uid"], None)
                elif member in pending:  # the gang waits, or this spare member finds no room
                    message = f"pod group {group}: {why}" if why else choose(member, nodes, used)[1]
                    _unschedulable(api, member, message, reported)
            continue
        chosen_node, message = choose(pod, nodes, used)
        if chosen_node is not None:
            api.patch("pods", ns, name, {"spec": {"nodeName": chosen_node}})
            _take(used, chosen_node, pod)
            reported.pop(pod["metadata"]["uid"], None)
            continue
        _unschedulable(api, pod, message, reported)


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
