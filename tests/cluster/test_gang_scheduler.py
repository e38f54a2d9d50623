"""The test cluster's scheduler places gangs as Coscheduling and Volcano do (all of a
PodGroup's minimum at once, or none), tried here against an in-memory API: no cluster is
started."""

from __future__ import annotations

import time
from typing import Any

import pytest
from kube_api import ApiError
from scheduler import place_gang, schedule_once

NS = "ml"
COSCHEDULING = "scheduling.x-k8s.io/v1alpha1"
VOLCANO = "scheduling.volcano.sh/v1beta1"


def _node(name: str, cpu: str = "4") -> dict[str, Any]:
    beat = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "metadata": {"name": name, "labels": {}},
        "spec": {},
        "status": {
            "allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": beat}],
        },
    }


def _pod(
    name: str,
    group: str | None,
    cpu: str = "3",
    *,
    created: str = "2026-01-01T00:00:00Z",
    volcano: bool = False,
    task: str = "trainer",
    node: str | None = None,
    phase: str = "Pending",
    **spec: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": f"uid-{name}",
        "creationTimestamp": created,
        "labels": {},
    }
    if group and volcano:
        meta["annotations"] = {"scheduling.k8s.io/group-name": group, "volcano.sh/task-spec": task}
    elif group:
        meta["labels"]["scheduling.x-k8s.io/pod-group"] = group
    body = {"containers": [{"name": "main", "resources": {"requests": {"cpu": cpu}}}], **spec}
    if node:
        body["nodeName"] = node
    return {"metadata": meta, "spec": body, "status": {"phase": phase}}


def _group(name: str, min_member: int, api: str = COSCHEDULING, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": api,
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"minMember": min_member, **spec},
    }


class FakeApi:
    """The calls the scheduler makes, on objects held here."""

    def __init__(self, nodes: list[dict], pods: list[dict], groups: list[dict]):
        self.nodes, self.groups = nodes, groups
        self.pods = {p["metadata"]["name"]: p for p in pods}

    def list(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return {"nodes": self.nodes, "pods": list(self.pods.values())}[kind]

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> Any:
        api = path.removeprefix("/apis/").removesuffix("/podgroups")
        items = [g for g in self.groups if g["apiVersion"] == api]
        if not items and api == VOLCANO:
            raise ApiError(404, "the server could not find the requested resource")
        return {"items": items}

    def patch(self, kind: str, ns: str, name: str, patch: Any, status: bool = False) -> Any:
        pod = self.pods[name]
        if status:
            pod["status"] = patch["status"]
        else:
            pod["spec"].update(patch["spec"])
        return pod

    def bound(self) -> dict[str, str]:
        return {n: p["spec"]["nodeName"] for n, p in self.pods.items() if p["spec"].get("nodeName")}

    def why(self, name: str) -> str:
        return self.pods[name]["status"]["conditions"][0]["message"]


def _two_nodes() -> list[dict[str, Any]]:
    """Fresh ones: a node whose heartbeat is over 10 s old takes no pods."""
    return [_node("node-a"), _node("node-b")]


def test_two_gangs_that_cannot_both_fit_never_hold_part_of_each_others_capacity():
    """2 nodes × 4 CPU; each gang 2 pods × 3 CPU, created interleaved (one pod at a time
    would give each job one node, and neither could start)."""
    pods = [
        _pod("a-0", "a", created="2026-01-01T00:00:00Z"),
        _pod("b-0", "b", created="2026-01-01T00:00:01Z"),
        _pod("a-1", "a", created="2026-01-01T00:00:02Z"),
        _pod("b-1", "b", created="2026-01-01T00:00:03Z"),
    ]
    api = FakeApi(_two_nodes(), pods, [_group("a", 2), _group("b", 2)])
    schedule_once(api, {})
    assert sorted(api.bound()) == ["a-0", "a-1"]
    assert set(api.bound().values()) == {"node-a", "node-b"}
    for name in ("b-0", "b-1"):
        why = api.why(name)
        assert why.startswith("pod group ml/b: 0 of its minMember 2 pods fit at once")
        assert "Insufficient cpu" in why
    schedule_once(api, {})
    assert sorted(api.bound()) == ["a-0", "a-1"]  # still nothing of b
    for name in ("a-0", "a-1"):
        api.pods[name]["status"]["phase"] = "Succeeded"
    schedule_once(api, {})
    assert sorted(api.bound()) == ["a-0", "a-1", "b-0", "b-1"]


def test_without_gangs_the_same_pods_split_the_capacity():
    """What the gang rule prevents: one pod of each job bound, neither job whole."""
    pods = [
        _pod("a-0", None, created="2026-01-01T00:00:00Z"),
        _pod("b-0", None, created="2026-01-01T00:00:01Z"),
        _pod("a-1", None, created="2026-01-01T00:00:02Z"),
    ]
    api = FakeApi(_two_nodes(), pods, [])
    schedule_once(api, {})
    assert sorted(api.bound()) == ["a-0", "b-0"]


def test_a_gang_waits_for_all_its_members_and_for_its_pod_group():
    api = FakeApi(_two_nodes(), [_pod("a-0", "a")], [_group("a", 2)])
    schedule_once(api, {})
    assert api.bound() == {} and api.why("a-0") == "pod group ml/a: 1 of its minMember 2 pods exist"
    api = FakeApi(_two_nodes(), [_pod("a-0", "a"), _pod("a-1", "a")], [])
    schedule_once(api, {})
    assert api.bound() == {} and api.why("a-0") == "pod group ml/a: its PodGroup does not exist"


def test_running_members_count_so_a_replacement_is_placed_alone():
    pods = [
        _pod("a-0", "a", node="node-a", phase="Running"),
        _pod("a-1", "a", node="node-b", phase="Running"),
        _pod("a-2", "a", cpu="1"),  # e.g. a recreated rollout pod
    ]
    api = FakeApi(_two_nodes(), pods, [_group("a", 3)])
    schedule_once(api, {})
    assert "a-2" in api.bound()


def test_spare_members_bind_when_they_fit_and_wait_alone_when_not():
    """minMember 2 of 3 (an elastic trainer above replicas.min): the 2 are placed, the
    third, which has no room, waits with the node's own reason."""
    pods = [_pod(f"a-{i}", "a", created=f"2026-01-01T00:00:0{i}Z") for i in range(3)]
    api = FakeApi(_two_nodes(), pods, [_group("a", 2)])
    schedule_once(api, {})
    assert sorted(api.bound()) == ["a-0", "a-1"]
    assert api.why("a-2") == "0/2 nodes are available: 2 Insufficient cpu."


def test_volcano_places_each_tasks_minimum_before_spare_members():
    """Room for 2 pods; minTaskMember trainer 1, rollout 1: the rollout pod, created last,
    goes before the second (spare) trainer."""
    pods = [
        _pod("t-0", "v", volcano=True, created="2026-01-01T00:00:00Z"),
        _pod("t-1", "v", volcano=True, created="2026-01-01T00:00:01Z"),
        _pod("r-0", "v", volcano=True, task="rollout", created="2026-01-01T00:00:02Z"),
    ]
    group = _group("v", 2, VOLCANO, minTaskMember={"trainer": 1, "rollout": 1})
    api = FakeApi(_two_nodes(), pods, [group])
    schedule_once(api, {})
    assert sorted(api.bound()) == ["r-0", "t-0"]


def test_volcano_short_of_a_task_places_nothing():
    pods = [
        _pod("t-0", "v", volcano=True, cpu="1"),
        _pod("t-1", "v", volcano=True, cpu="1"),
        _pod("r-0", "v", volcano=True, task="rollout", cpu="5"),  # fits no node
    ]
    group = _group("v", 2, VOLCANO, minTaskMember={"trainer": 1, "rollout": 1})
    api = FakeApi(_two_nodes(), pods, [group])
    schedule_once(api, {})
    assert api.bound() == {}
    assert "tasks short: rollout" in api.why("t-0")


@pytest.mark.parametrize(
    "spec", [{"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}, {"schedulerName": "x"}]
)
def test_gated_pods_and_other_schedulers_pods_are_left_alone(spec):
    api = FakeApi(_two_nodes(), [_pod("p", None, cpu="1", **spec)], [])
    schedule_once(api, {})
    assert api.bound() == {} and "conditions" not in api.pods["p"]["status"]


def test_place_gang_is_pure():
    used = {"node-a": {"cpu": 1.0}, "node-b": {}}
    members = [_pod("a-0", "a"), _pod("a-1", "a")]
    chosen, why = place_gang(_group("a", 2), members, _two_nodes(), used)
    assert chosen == {"a-0": "node-b", "a-1": "node-a"} and why == ""
    assert used == {"node-a": {"cpu": 1.0}, "node-b": {}}
