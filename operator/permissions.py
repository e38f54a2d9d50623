"""Every Kubernetes API permission the operator needs, declared once.

The Helm chart's RBAC is generated from this list (`python -m rlft.operator.chart_files`
writes `charts/rlft/files/permissions.yaml`, which the RBAC templates read), and the
operator's own REST client (`kube.Kube`) refuses any request this list does not declare,
so a new API call cannot ship without its permission. The calls kopf makes on the
operator's behalf (watches, finalizer and annotation patches, leader-election peering,
discovery of namespaces and CRDs) are declared here too, and so is the one check the API
server makes in the operator's name: `update` on `rlfinetunes/finalizers`, which the
OwnerReferencesPermissionEnforcement admission plugin asks for before it accepts a child
whose owner reference sets blockOwnerDeletion. The chart tests run the real operator
against an emulated API server, record every request it makes (and that admission check,
on each create it applies to), and check that each one is declared and that each declared
verb is used.

The PodGroups of gang scheduling (`GANG_PERMISSIONS`) are declared apart: the chart grants
them only with `rbac.gangScheduling: true`, for clusters that run Volcano or
scheduler-plugins.

Two modes, as `python -m rlft.operator` runs them: `namespaced` (`-n NS`, one Role per
served namespace) and `clusterwide` (`-A`, a ClusterRole). `scope` says where a rule
applies: `served` resources live in the namespaces the operator serves (all of them when
clusterwide); `cluster` resources are cluster-scoped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from rlft.operator import crd

Mode = Literal["namespaced", "clusterwide"]
MODES: tuple[Mode, ...] = ("namespaced", "clusterwide")
BOTH: tuple[Mode, ...] = MODES


@dataclass(frozen=True)
class Permission:
    """Verbs on one resource (a subresource is written `resource/sub`)."""

    group: str
    resource: str
    verbs: tuple[str, ...]
    scope: Literal["served", "cluster"]
    modes: tuple[Mode, ...]
    why: str


PERMISSIONS: tuple[Permission, ...] = (
    Permission(
        crd.GROUP,
        crd.PLURAL,
        ("get", "list", "watch", "patch"),
        "served",
        BOTH,
        "watch jobs (kopf); read one fresh per reconcile; finalizer, annotations and "
        "spec.suspend patches",
    ),
    Permission(
        crd.GROUP, f"{crd.PLURAL}/status", ("patch",), "served", BOTH, "write the job's status"
    ),
    Permission(
        crd.GROUP,
        f"{crd.PLURAL}/finalizers",
        ("update",),
        "served",
        BOTH,
        "create children whose owner reference sets blockOwnerDeletion: where the "
        "OwnerReferencesPermissionEnforcement admission plugin is on (OpenShift, hardened "
        "clusters) the API server checks this verb on the owner for every such create; the "
        "operator itself never sends it",
    ),
    Permission(
        "",
        "pods",
        ("list", "watch", "create", "delete"),
        "served",
        BOTH,
        "watch the jobs' pods (kopf: a change reconciles its job) and list them at each "
        "reconcile; create them, delete failed or surplus ones",
    ),
    Permission(
        "",
        "services",
        ("list", "create", "delete"),
        "served",
        BOTH,
        "headless Services of the trainer rendezvous and the rollout instances",
    ),
    Permission(
        "",
        "configmaps",
        ("list", "create", "patch", "delete"),
        "served",
        BOTH,
        "the ConfigMap with the rendered job file; re-rendered after an edit while no pod reads it",
    ),
    Permission(
        "",
        "secrets",
        ("create",),
        "served",
        BOTH,
        "the Secret of each job's rollout token (created with a fresh token; never read)",
    ),
    Permission(
        "networking.k8s.io",
        "networkpolicies",
        ("create",),
        "served",
        BOTH,
        "each job's NetworkPolicy (--job-network-policy): its pods' ports open to each other",
    ),
    Permission("", "events", ("create",), "served", BOTH, "one Event per decision"),
    Permission(
        "kopf.dev",
        "kopfpeerings",
        ("list", "watch", "create", "patch"),
        "served",
        ("namespaced",),
        "leader election between replicas (created at start-up, kept alive by kopf)",
    ),
    Permission(
        "kopf.dev",
        "clusterkopfpeerings",
        ("list", "watch", "create", "patch"),
        "cluster",
        ("clusterwide",),
        "leader election between replicas serving all namespaces",
    ),
    Permission(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        "cluster",
        BOTH,
        "kopf notices CRDs installed or changed after it started",
    ),
    Permission(
        "",
        "namespaces",
        ("list", "watch"),
        "cluster",
        ("namespaced",),
        "kopf checks that the served namespaces exist and follows them",
    ),
)


GANG_PERMISSIONS: tuple[Permission, ...] = tuple(
    Permission(
        group,
        "podgroups",
        ("create", "patch"),
        "served",
        BOTH,
        f"{project} PodGroups of jobs with spec.scheduling.gang.kind {kind}: created before "
        "the pods; patched to the current gang minimum when one already exists",
    )
    for group, project, kind in (
        ("scheduling.volcano.sh", "Volcano", "volcano"),
        ("scheduling.x-k8s.io", "scheduler-plugins (coscheduling)", "coscheduling"),
    )
)
"""Granted only with the chart's `rbac.gangScheduling: true` (a cluster without Volcano or
scheduler-plugins has no such API, and the operator then needs none of it): the chart
adds them to the served rules. The operator deletes no PodGroup: each is owned by its
job, and the garbage collector removes it with the job."""


class UndeclaredRequest(Exception):
    """A request no Permission declares: a programming error (add the permission)."""


def rules(mode: Mode, scope: str) -> list[dict[str, list[str]]]:
    """RBAC rules (as in a Role) of one mode and scope, in declaration order."""
    out = []
    for p in PERMISSIONS:
        if mode in p.modes and p.scope == scope:
            out.append({"apiGroups": [p.group], "resources": [p.resource], "verbs": list(p.verbs)})
    return out


_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<namespace>[^/]+))?"
    r"/(?P<resource>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)


def classify(method: str, path: str, watch: bool = False) -> tuple[str, str, str]:
    """(apiGroup, resource[/sub], verb) of a resource request, as the API server's RBAC
    sees it."""
    bare = path.split("?", 1)[0]
    match = _PATH.match(bare)
    if match is None:
        raise UndeclaredRequest(f"{method} {bare}: not a resource path")
    parts = match.groupdict()
    group = parts["group"] or ""
    resource = parts["resource"]
    name = parts["name"]
    if parts["sub"]:
        resource = f"{resource}/{parts['sub']}"
    verbs = {"POST": "create", "PATCH": "patch", "PUT": "update"}
    if method == "GET":
        verb = "watch" if watch else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = verbs.get(method, method.lower())
    return group, resource, verb


def declared(group: str, resource: str, verb: str) -> bool:
    return any(
        p.group == group and p.resource == resource and verb in p.verbs
        for p in PERMISSIONS + GANG_PERMISSIONS
    )


def require(method: str, path: str, watch: bool = False) -> None:
    """Raise UndeclaredRequest unless PERMISSIONS declares this request."""
    group, resource, verb = classify(method, path, watch)
    if not declared(group, resource, verb):
        raise UndeclaredRequest(
            f"{method} {path.split('?', 1)[0]}: {verb} on {resource!r} (group {group!r}) is not "
            "declared in rlft.operator.permissions.PERMISSIONS; declare it there (the Helm "
            "chart's RBAC is generated from that list)"
        )
