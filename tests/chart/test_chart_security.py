"""The chart's security posture, for every combination of toggles: containers non-root,
unprivileged, read-only root filesystem, all capabilities dropped, seccomp; RBAC without
wildcards and with exactly the permissions `rlft.operator.permissions` declares (the list
the operator's REST client enforces on itself, and the recorded-requests test checks
against what the running operator really asks for)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from chart_render import ALL_TOGGLES, NAMESPACE, NAMESPACED, of_kind, render

from rlft.operator import permissions

CASES = {
    "defaults": {},
    "all-toggles": ALL_TOGGLES,
    "namespaced": NAMESPACED,
    "namespaced-all-toggles": {**ALL_TOGGLES, **NAMESPACED},
    "own-user": {"securityContext": {"runAsUser": 4242, "runAsGroup": 4242}},
}


def _pod_specs(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    specs = []
    for document in documents:
        template = document.get("spec", {}).get("template")
        if template is not None:
            specs.append(template["spec"])
        elif document["kind"] == "Pod":
            specs.append(document["spec"])
    return specs


@pytest.mark.parametrize("case", CASES)
def test_no_container_runs_as_root_or_privileged(chart, case):
    documents, _ = render(chart, CASES[case])
    specs = _pod_specs(documents)
    assert len(specs) == 1  # the operator Deployment; the chart starts nothing else
    for spec in specs:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0 and pod["runAsGroup"] > 0
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(flag)
        assert all("hostPath" not in volume for volume in spec.get("volumes", []))
        containers = spec["containers"] + spec.get("initContainers", [])
        for container in containers:
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True and sc.get("runAsUser", pod["runAsUser"]) > 0
            assert sc.get("privileged", False) is False
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}  # and nothing added
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert "ports" not in container or all(
                p["containerPort"] >= 1024 for p in container["ports"]
            )
            assert container["resources"]["limits"]["memory"]
        assert [v["name"] for v in spec["volumes"]] == ["tmp"]  # the only writable place


def _rules(document: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in document["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _declared(mode: str, scope: str) -> set[tuple[str, str, str]]:
    return {
        (p.group, p.resource, verb)
        for p in permissions.PERMISSIONS
        if mode in p.modes and p.scope == scope
        for verb in p.verbs
    }


@pytest.mark.parametrize("case", CASES)
def test_rbac_has_no_wildcards_and_reads_no_secrets(chart, case):
    documents, _ = render(chart, CASES[case])
    roles = of_kind(documents, "Role") + of_kind(documents, "ClusterRole")
    assert roles
    for role in roles:
        for rule in role["rules"]:
            assert set(rule) <= {"apiGroups", "resources", "verbs"}  # no nonResourceURLs,
            for key in ("apiGroups", "resources", "verbs"):  # no resourceNames tricks
                assert rule[key] and not any("*" in item for item in rule[key]), rule
            # Credentials are referenced by Secret name in pods; the operator never reads
            # a Secret. It creates one per job, the rollout token's, and can do no more.
            if "secrets" in rule["resources"]:
                assert rule["resources"] == ["secrets"] and rule["verbs"] == ["create"], rule
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_clusterwide_rbac_is_exactly_the_declared_permissions(chart):
    documents, _ = render(chart)
    assert of_kind(documents, "Role") == [] and of_kind(documents, "RoleBinding") == []
    (role,) = of_kind(documents, "ClusterRole")
    wanted = _declared("clusterwide", "served") | _declared("clusterwide", "cluster")
    assert _rules(role) == wanted
    (binding,) = of_kind(documents, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    (account,) = of_kind(documents, "ServiceAccount")
    subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"]}
    assert binding["subjects"] == [{**subject, "namespace": NAMESPACE}]
    deployment = of_kind(documents, "Deployment")[0]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == subject["name"]


def test_namespaced_rbac_is_a_role_per_namespace_and_only_cluster_scoped_reads(chart):
    documents, _ = render(chart, NAMESPACED)
    roles = {r["metadata"]["namespace"]: r for r in of_kind(documents, "Role")}
    assert sorted(roles) == ["ml", "research"]
    for namespace, role in roles.items():
        assert _rules(role) == _declared("namespaced", "served")
        (binding,) = [
            b for b in of_kind(documents, "RoleBinding") if b["metadata"]["namespace"] == namespace
        ]
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    (cluster_role,) = of_kind(documents, "ClusterRole")
    assert _rules(cluster_role) == _declared("namespaced", "cluster")
    # cluster-wide, only reads of CRDs and namespaces (kopf's discovery); no writes at all
    assert {verb for _, _, verb in _rules(cluster_role)} == {"list", "watch"}


def test_rbac_can_be_left_to_the_cluster_admin(chart):
    documents, _ = render(
        chart, {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops"}}
    )
    kinds = {d["kind"] for d in documents}
    assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    assert "ServiceAccount" not in kinds
    deployment = of_kind(documents, "Deployment")[0]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_every_declared_permission_is_in_some_mode_and_unique():
    seen = set()
    for p in permissions.PERMISSIONS:
        assert p.modes and set(p.modes) <= set(permissions.MODES) and p.why
        assert len(set(p.verbs)) == len(p.verbs)
        key = (p.group, p.resource, p.scope)
        assert key not in seen
        seen.add(key)


def test_releases_of_distinct_names_get_distinct_cluster_roles(chart):
    """ClusterRoles are cluster-wide, so their names carry the release's namespace. Two
    releases whose names differ (so do their Deployments) must not share a ClusterRole:
    Helm refuses to install an object another release owns."""
    namespace = "ml-platform-operators-production"
    names = {}
    for release in ("rlft-research-gpu-cluster-east-1", "rlft-research-gpu-cluster-east-2"):
        out = chart.render({}, name=release, namespace=namespace)
        texts = [text for template, text in out.items() if not template.endswith("NOTES.txt")]
        documents = [d for text in texts for d in yaml.safe_load_all(text) if d]
        (deployment,) = of_kind(documents, "Deployment")
        (role,) = of_kind(documents, "ClusterRole")
        (binding,) = of_kind(documents, "ClusterRoleBinding")
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert namespace in role["metadata"]["name"]
        names[deployment["metadata"]["name"]] = role["metadata"]["name"]
    assert len(names) == 2
    assert len(set(names.values())) == 2, names


def test_a_large_uid_renders_as_the_integer_it_is(chart):
    """Helm reads values as floats: an OpenShift-range UID rendered as `1.00068e+09`,
    which the API server's int64 fields refuse (and a YAML reader takes for a float)."""
    uid, gid = 1000680000, 1000690000
    documents, _ = render(chart, {"securityContext": {"runAsUser": uid, "runAsGroup": gid}})
    [spec] = _pod_specs(documents)
    ids = [spec["securityContext"][k] for k in ("runAsUser", "runAsGroup", "fsGroup")]
    for container in spec["containers"] + spec.get("initContainers", []):
        ids += [container["securityContext"][k] for k in ("runAsUser", "runAsGroup")]
    assert ids and all(type(i) is int for i in ids), ids
    assert set(ids) == {uid, gid}
