"""Gang scheduling and queueing of a job's pods (`spec.scheduling.gang`): pure functions
from the job to what the pods carry and to the PodGroup a gang scheduler reads.

Which pods form the gang, per kind (why: docs/architecture.md, "Gang scheduling"):

- `volcano`, `coscheduling`: one PodGroup per job, `<job>-gang`, whose minimum is
  `replicas.min` trainer pods and every rollout pod (Ray heads and workers included). A
  trainer gang placed while its rollout instances cannot be is idle (rank 0 waits for
  samples) and holds its GPUs, so the job's smallest useful unit is all of them. The
  trainer pods above `replicas.min` (elastic) are members too: placed when there is
  room, never needed to start. Pods replaced one at a time (a failed rollout pod, a
  restarted trainer gang) join the same PodGroup; the members still running count.
- `kueue`: Kueue's plain-pod integration. The trainer pods of one gang attempt are one
  pod group, `<job>-trainers-<status.gangAttempt>`, of `replicas.max` pods (Kueue admits
  a group's quota whole and needs every pod of it to exist). Kueue keeps a finalizer on
  a failed member until a *replacement* pod joins its group; the operator's pods have
  fixed names, so a replacement can only be created once the old pod is gone. Hence the
  group is one-shot (`retriable-in-group: "false"`): the operator restarts a gang only
  whole (every trainer pod deleted), Kueue then finishes the group and releases its
  quota, and the next attempt's pods queue again as a new group. Rollout pods outlive
  trainer restarts and are replaced one by one, so each is a single Kueue pod (its queue
  label only): a pod group holding them would never finish while they run.

The label and annotation names are the projects' own; the tests check them against the
vendored source (tests/operator/data/gang/).
"""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction
from typing import Any

from rlft.operator import names as N
from rlft.trainer.config import RLFineTune
from rlft.trainer.config.gang import GangSpec
from rlft.trainer.config.pods import QUANTITY_SUFFIXES, quantity

# Kueue (sigs.k8s.io/kueue: pkg/controller/constants, pkg/controller/jobs/pod/constants)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
# Volcano (volcano.sh/apis: scheduling/v1beta1/labels.go, batch/v1alpha1/labels.go)
VOLCANO_API = "scheduling.volcano.sh/v1beta1"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
VOLCANO_TASK_ANNOTATION = "volcano.sh/task-spec"
# scheduler-plugins' Coscheduling (sigs.k8s.io/scheduler-plugins: apis/scheduling/v1alpha1)
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"

POD_GROUP_APIS = {"volcano": VOLCANO_API, "coscheduling": COSCHEDULING_API}
"""apiVersion of the PodGroup each kind creates (kueue creates none: Kueue makes its own
Workload from the pods)."""


def spec_of(job: RLFineTune) -> GangSpec:
    return job.spec.scheduling.gang


def group_name(job: str) -> str:
    """The job's PodGroup (volcano, coscheduling): a label value, so at most 63 long."""
    return N.child_name(job, "gang")


def kueue_group(job: str, attempt: int) -> str:
    """The Kueue pod group (and Workload) of the trainer gang's attempt `attempt`."""
    return N.child_name(job, f"trainers-{attempt}")


def apply(pod: dict[str, Any], job: RLFineTune, role: str, attempt: int = 0) -> dict[str, Any]:
    """Add what the gang kind needs to one pod of the job (its labels, annotations and
    schedulerName); `attempt` is the trainer gang's (status.gangAttempt). The gang's
    keys win over a role's own `pod.labels`/`annotations` of the same name."""
    gang = spec_of(job)
    if gang.kind == "none":
        return pod
    metadata = pod["metadata"]
    labels = metadata.setdefault("labels", {})
    annotations = metadata.setdefault("annotations", {})
    scheduler = gang.pod_scheduler()
    if scheduler is not None:
        pod["spec"]["schedulerName"] = scheduler
    if gang.kind == "kueue":
        labels[KUEUE_QUEUE_LABEL] = gang.queue_name or ""
        if role == N.ROLE_TRAINER:
            labels[KUEUE_GROUP_LABEL] = kueue_group(job.metadata.name, attempt)
            annotations[KUEUE_TOTAL_COUNT] = str(job.spec.trainer.replicas.max)
            annotations[KUEUE_RETRIABLE] = "false"
    elif gang.kind == "volcano":
        annotations[VOLCANO_GROUP_ANNOTATION] = group_name(job.metadata.name)
        annotations[VOLCANO_TASK_ANNOTATION] = role  # the key of minTaskMember
    elif gang.kind == "coscheduling":
        labels[COSCHEDULING_GROUP_LABEL] = group_name(job.metadata.name)
    if not annotations:
        metadata.pop("annotations")
    return pod


def _role(pod: dict[str, Any]) -> str:
    return pod["metadata"]["labels"][N.LABEL_ROLE]


def minimum_members(job: RLFineTune, pods: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Pods of each role the gang needs at once: replicas.min trainers, every other pod."""
    need: dict[str, int] = {}
    for pod in pods:
        need[_role(pod)] = need.get(_role(pod), 0) + 1
    if N.ROLE_TRAINER in need:
        need[N.ROLE_TRAINER] = job.spec.trainer.replicas.min
    return need


def pod_groups(
    job: RLFineTune, pods: dict[str, dict[str, Any]], metadata: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """The PodGroup of the job (volcano, coscheduling; none otherwise), for its `pods`
    (the planner's, whose requests give minResources), with `metadata` the planner's
    (name, namespace, labels, owner reference)."""
    gang = spec_of(job)
    api = POD_GROUP_APIS.get(gang.kind)
    if api is None or not pods:
        return {}
    members = list(pods.values())
    need = minimum_members(job, members)
    spec: dict[str, Any] = {"minMember": sum(need.values())}
    if gang.kind == "volcano":
        # Per role: a count alone could be met by spare elastic trainers instead of the
        # rollout pods the trainers wait for.
        spec["minTaskMember"] = dict(sorted(need.items()))
    resources = min_resources(members, need)
    if resources:
        spec["minResources"] = resources
    if gang.kind == "volcano":
        if gang.queue_name:
            spec["queue"] = gang.queue_name
        if job.spec.scheduling.priority_class_name:
            spec["priorityClassName"] = job.spec.scheduling.priority_class_name
    group = {"apiVersion": api, "kind": "PodGroup", "metadata": metadata, "spec": spec}
    return {metadata["name"]: group}


# ----------------------------------------------------------------- quantities

_BYTES = ("memory", "ephemeral-storage", "hugepages-")


def format_quantity(resource: str, amount: Fraction) -> str:
    """Canonical text of a sum: bytes with the exact suffix that gives the smallest number,
    other whole amounts as integers, fractions in millis (rounded up: never less than
    the pods ask)."""
    if amount.denominator != 1:
        return f"{-(-amount * 1000 // 1)}m"
    whole = int(amount)
    if resource.startswith(_BYTES) and whole:
        exact = [
            (whole // int(QUANTITY_SUFFIXES[suffix]), suffix)
            for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki", "E", "P", "T", "G", "M", "k")
            if whole % QUANTITY_SUFFIXES[suffix] == 0
        ]
        if exact:  # the shortest: 2G rather than 1953125Ki
            number, suffix = min(exact, key=lambda pair: pair[0])
            return f"{number}{suffix}"
    return str(whole)


def _requests(pod: dict[str, Any]) -> dict[str, Fraction]:
    """What the pod asks of a node: its containers' requests, a limit where no request is
    given (Kubernetes defaults the request to the limit)."""
    total: dict[str, Fraction] = {}
    for container in pod["spec"]["containers"]:
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in asked.items():
            total[name] = total.get(name, Fraction(0)) + quantity(value)
    return total


def min_resources(pods: list[dict[str, Any]], need: dict[str, int]) -> dict[str, str]:
    """The resources of the gang's minimum: the first `need[role]` pods of each role (in
    the planner's order: trainer-0 first)."""
    left = dict(need)
    total: dict[str, Fraction] = {}
    for pod in pods:
        role = _role(pod)
        if left.get(role, 0) <= 0:
            continue
        left[role] -= 1
        for name, amount in _requests(pod).items():
            total[name] = total.get(name, Fraction(0)) + amount
    return {name: format_quantity(name, total[name]) for name in sorted(total) if total[name]}
