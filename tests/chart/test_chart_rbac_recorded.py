"""The chart's RBAC against what the operator really does.

The real operator process (kopf included), started with the arguments the chart's
Deployment renders, runs against an emulated API server (kmock-based, not a cluster) that
records every request, and the authorization check that OwnerReferencesPermissionEnforcement
admission makes for each child it creates (owner references with blockOwnerDeletion need
`update` on `rlfinetunes/finalizers`). A job goes through its life: children created, a pod
OOM-killed and recreated, suspend, an edit while suspended (its ConfigMap re-rendered),
deletion through the finalizer. Then, for both modes (all namespaces; a list of
namespaces):

- every request the operator made is allowed by the rendered Roles/ClusterRoles bound to
  its ServiceAccount (RBAC evaluated here, independently of rlft.operator.permissions);
- every verb the chart grants was used: no permission the operator does not need.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import cluster
import pytest
from chart_render import NAMESPACE, of_kind, render
from cluster import OperatorProcess, wait_for
from jobs import job_doc, parsed
from test_operator_integration import (
    _job,
    _namespace,
    _oom,
    _run_all,
    _start_api,
    _started,
    _wait_phase,
)

from rlft.operator import crd, permissions, plan
from rlft.operator.kube import Connection, Kube

HERE = Path(__file__).resolve().parent
JOB_NS = "ml"
MODES = ["clusterwide", "namespaced"]
DISCOVERY = re.compile(r"^/api(/v1)?$|^/apis(/[^/]+){0,2}$|^/version$")
RESOURCE = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)"
    r"(?:/namespaces/(?P<ns>[^/]+)(?=/[^/]+))?"
    r"/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)


def rbac_request(line: dict[str, Any]) -> tuple[str | None, str, str, str] | None:
    """(namespace or None, apiGroup, resource[/sub], verb); None for discovery, which every
    authenticated user may read (system:discovery)."""
    path = line["path"]
    if DISCOVERY.match(path):
        return None
    match = RESOURCE.match(path)
    assert match, f"unexpected path {path}"
    resource = match["resource"] + (f"/{match['sub']}" if match["sub"] else "")
    method = line["method"]
    if method == "GET":
        verb = "watch" if line["watch"] else ("get" if match["name"] else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
        if method == "DELETE" and not match["name"]:
            verb = "deletecollection"
    return match["ns"], match["group"] or "", resource, verb


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def allowed(documents: list[dict[str, Any]], request: tuple[str | None, str, str, str]) -> bool:
    """What kube-apiserver's RBAC authorizer would say for the chart's ServiceAccount."""
    namespace, group, resource, verb = request
    (account,) = of_kind(documents, "ServiceAccount")
    me = {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    roles = {
        (r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]): r
        for r in documents
        if r["kind"] in ("Role", "ClusterRole")
    }
    for binding in of_kind(documents, "ClusterRoleBinding") + of_kind(documents, "RoleBinding"):
        if me not in binding["subjects"]:
            continue
        where = binding["metadata"].get("namespace")  # None: cluster-wide
        if where is not None and where != namespace:
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], where if ref["kind"] == "Role" else None, ref["name"]))
        if role is not None and (group, resource, verb) in _grants(role):
            return True
    return False


def _run_lifecycle(tmp_path: Path, monkeypatch, values: dict[str, Any], chart) -> tuple[list, list]:
    """Start the emulated API server and the operator with the chart's arguments, take a
    job through its life; returns (the operator's requests, the rendered chart)."""
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setattr(cluster, "EMULATOR", HERE / "recording_api.py")
    monkeypatch.setenv("RLFT_RECORD_REQUESTS", str(requests))
    documents, _ = render(chart, values)
    container = of_kind(documents, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    args = [a for a in container["args"] if not a.startswith("--metrics-bind")]
    api = _start_api(tmp_path / "api")
    operator = None
    try:
        ns = _namespace(api, JOB_NS)
        operator = OperatorProcess(api, *args, "--poll-seconds=1")
        restart = {"maxRestarts": 3, "backoffSeconds": 1, "windowMinutes": 60}
        api.apply(job_doc(name="life", namespace=ns, restartPolicy=restart))
        _started(api, ns, "life", 2)
        _run_all(api, ns, "life")
        _wait_phase(api, ns, "life", "Running")
        _oom(api, ns, "life-trainer-0")
        wait_for(lambda: _job(api, ns, "life")["status"].get("restarts") == 1, "a restart")
        api.kubectl(
            "patch", "rlft", "life", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}'
        )
        _wait_phase(api, ns, "life", "Suspended")
        edit = '{"spec":{"trainer":{"steps":77}}}'  # re-renders the ConfigMap (patch)
        api.kubectl("patch", "rlft", "life", "-n", ns, "--type=merge", "-p", edit)
        wait_for(
            lambda: (
                "steps: 77" in api.get("configmap", "life-config", "-n", ns)["data"]["job.yaml"]
            ),
            "the ConfigMap re-rendered",
        )
        api.kubectl("delete", "rlft", "life", "-n", ns, "--timeout=30s")
        assert api.get("configmap", "life-config", "-n", ns) is None  # the finalizer ran
    finally:
        if operator is not None:
            operator.stop()
        api.stop()
    lines = [json.loads(line) for line in requests.read_text().splitlines()]
    mine = [line for line in lines if not line["agent"].startswith("kubectl")]
    assert {line["agent"].split("/")[0] for line in mine} == {"kopf", "Python"}, "two clients"
    assert any(line.get("admission") for line in mine), "the admission checks are recorded"
    return mine, documents


@pytest.mark.parametrize(
    ("mode", "values"),
    [("clusterwide", {}), ("namespaced", {"watchNamespaces": [JOB_NS]})],
)
def test_operator_requests_are_exactly_what_the_chart_grants(
    chart, tmp_path, monkeypatch, mode, values
):
    lines, documents = _run_lifecycle(tmp_path, monkeypatch, values, chart)
    requests = {r for r in map(rbac_request, lines) if r is not None}
    denied = sorted(r for r in requests if not allowed(documents, r))
    assert denied == [], f"the chart's RBAC would deny the operator: {denied}"
    used = {(group, resource, verb) for _, group, resource, verb in requests}
    granted = set()
    for role in of_kind(documents, "Role") + of_kind(documents, "ClusterRole"):
        granted |= _grants(role)
    assert granted - used == set(), "granted but never used"
    # the declared list is the chart's source, and matches too
    declared = {
        (p.group, p.resource, v)
        for p in permissions.PERMISSIONS
        if mode in p.modes
        for v in p.verbs
    }
    assert declared == used


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": [JOB_NS]}], ids=MODES)
def test_children_may_block_their_jobs_deletion(chart, values):
    """Every child the operator creates sets blockOwnerDeletion on its owner reference to
    the job; where OwnerReferencesPermissionEnforcement is on, kube-apiserver admits that
    create only if the creator may `update` the job's `finalizers`: the chart grants it."""
    documents, _ = render(chart, values)
    job, body = parsed(job_doc(namespace=JOB_NS))
    children = plan.plan(job, JOB_NS, body["metadata"]["uid"])
    owners = [ref for child in children for ref in child["metadata"]["ownerReferences"]]
    assert len(owners) == len(children) and all(ref["blockOwnerDeletion"] for ref in owners)
    assert {(ref["apiVersion"], ref["kind"]) for ref in owners} == {
        (f"{crd.GROUP}/{crd.VERSION}", "RLFineTune")
    }
    check = (JOB_NS, crd.GROUP, f"{crd.PLURAL}/finalizers", "update")
    assert allowed(documents, check)
    for role in of_kind(documents, "Role") + of_kind(documents, "ClusterRole"):
        role["rules"] = [r for r in role["rules"] if r["resources"] != [check[2]]]
    assert not allowed(documents, check)  # the rule is what grants it


def test_the_rbac_evaluation_is_real(chart):
    documents, _ = render(chart, {"watchNamespaces": [JOB_NS]})
    create_pod = (JOB_NS, "", "pods", "create")
    assert allowed(documents, create_pod)
    assert not allowed(documents, ("elsewhere", "", "pods", "create"))  # not a served namespace
    assert not allowed(documents, (None, "", "pods", "list"))  # not cluster-wide
    assert allowed(documents, (None, "", "namespaces", "watch"))
    assert not allowed(documents, (JOB_NS, "", "secrets", "get"))
    (role,) = of_kind(documents, "Role")
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["pods"]]
    assert not allowed(documents, create_pod)
    assert rbac_request({"method": "GET", "path": "/api/v1/pods", "watch": True}) == (
        None,
        "",
        "pods",
        "watch",
    )
    line = {"method": "PATCH", "path": "/apis/rlft.dev/v1alpha1/namespaces/ml/rlfinetunes/j/status"}
    assert rbac_request({**line, "watch": False}) == (
        JOB_NS,
        "rlft.dev",
        "rlfinetunes/status",
        "patch",
    )
    assert rbac_request({"method": "GET", "path": "/apis/kopf.dev/v1", "watch": False}) is None


def test_the_operators_client_refuses_undeclared_requests():
    kube = Kube(Connection(server="http://127.0.0.1:9", headers={}))
    import asyncio

    with pytest.raises(permissions.UndeclaredRequest, match="secrets"):
        asyncio.run(kube._request("GET", "/api/v1/namespaces/ml/secrets/s3-credentials"))
    with pytest.raises(permissions.UndeclaredRequest, match="update"):
        asyncio.run(kube._request("PUT", "/api/v1/namespaces/ml/pods/p", {}))
    # and what it does send is declared (the lifecycle test above exercises every path)
    permissions.require("DELETE", "/api/v1/namespaces/ml/configmaps/x-config")
    permissions.require("PATCH", "/apis/rlft.dev/v1alpha1/namespaces/ml/rlfinetunes/x/status")
