"""Gang scheduling and queueing of a job's pods (`spec.scheduling.gang`; Kubernetes only).

A job's pods are useful only together: torchrun's rendezvous waits for `replicas.min`
trainer pods, and a trainer gang whose rollout instances have no node only waits. Two jobs
placed pod by pod on a full cluster can each hold part of the capacity and neither start.
A gang scheduler places a job's pods all at once or not at all; a queue admits a job only
when its quota allows. This section picks which of the common ones the pods are written
for (`kind`), and names the queue and the scheduler. What each kind makes of the pods is
`rlft.operator.gang`; why, and what the cluster must run: docs/architecture.md, "Gang
scheduling".
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from rlft.trainer.config.base import Section

GangKind = Literal["none", "kueue", "volcano", "coscheduling"]

DEFAULT_SCHEDULERS: dict[str, str] = {
    "volcano": "volcano",
    "coscheduling": "scheduler-plugins-scheduler",
}
"""schedulerName of the pods per kind unless `schedulerName` says otherwise: Volcano's
scheduler, and the name scheduler-plugins' chart (`as-a-second-scheduler`) gives the
scheduler running the Coscheduling plugin. Kueue admits pods for whichever scheduler
places them, so it sets none."""

# A DNS-1123 subdomain: what Volcano's Queue names, Kueue's LocalQueue names and Kubernetes'
# schedulerName are.
SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _matching(what: str) -> AfterValidator:
    """The pattern in pydantic with a message in words (the CRD gets the pattern itself)."""
    compiled = re.compile(SUBDOMAIN_PATTERN)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(f"{value!r} is not {what} (lower-case letters, digits, '-', '.')")
        return value

    return AfterValidator(check)


QueueName = Annotated[
    str,
    # 63: Kueue's becomes a label value.
    Field(min_length=1, max_length=63, json_schema_extra={"pattern": SUBDOMAIN_PATTERN}),
    _matching("a queue name"),
]
SchedulerName = Annotated[
    str,
    Field(min_length=1, max_length=253, json_schema_extra={"pattern": SUBDOMAIN_PATTERN}),
    _matching("a scheduler name"),
]


class GangSpec(Section):
    """Gang scheduling and queueing of the job's pods (Kubernetes only), so that two jobs
    that cannot both fit do not each hold part of the other's capacity. With `volcano` or
    `coscheduling` the job's minimum, `replicas.min` trainer pods and every rollout pod, is
    placed whole or not at all; with `kueue` each trainer gang attempt, `replicas.max`
    trainer pods, is admitted whole, and each rollout pod on its own (`kind` says more).
    The cluster must run the chosen system, and the operator needs the chart's
    `rbac.gangScheduling` for the PodGroups of `volcano` and `coscheduling`."""

    kind: GangKind = "none"
    """`none`: each pod is scheduled on its own by the cluster's scheduler. `kueue`: the
    pods wait in a Kueue LocalQueue (`queueName`) until their quota is admitted; the
    trainer pods of each gang attempt are one Kueue pod group, admitted together, and
    each rollout pod is admitted on its own. `volcano`: one Volcano PodGroup per job, of
    `replicas.min` trainer pods and every rollout pod (Ray heads and workers included),
    placed together by Volcano's scheduler. `coscheduling`: the same as a
    scheduler-plugins PodGroup, placed together by the Coscheduling plugin."""
    queue_name: QueueName | None = None
    """`kueue`: the LocalQueue in the job's namespace (required; it becomes the pods'
    `kueue.x-k8s.io/queue-name` label). `volcano`: the Volcano Queue of the PodGroup
    (unset: Volcano's `default` queue). `coscheduling` has no queues."""
    scheduler_name: SchedulerName | None = None
    """The pods' schedulerName, where the gang scheduler runs under another name than its
    default: `volcano` for `volcano`, `scheduler-plugins-scheduler` for `coscheduling`
    (scheduler-plugins installed as a second scheduler; `default-scheduler` where the
    plugin is enabled in the cluster's own scheduler); `kueue`: unset, the cluster's
    default scheduler."""

    @model_validator(mode="after")
    def _fits_kind(self) -> GangSpec:
        if self.kind == "kueue" and self.queue_name is None:
            raise ValueError(
                "kind kueue needs queueName: the LocalQueue in the job's namespace whose "
                "ClusterQueue admits the pods (kubectl get localqueues -n NAMESPACE)"
            )
        if self.kind == "coscheduling" and self.queue_name is not None:
            raise ValueError(
                "kind coscheduling has no queues: remove queueName, or use kind kueue or "
                "volcano to queue the job"
            )
        if self.kind == "none" and (self.queue_name or self.scheduler_name):
            raise ValueError(
                "queueName and schedulerName need a gang kind: set kind to kueue, volcano "
                "or coscheduling, or remove them"
            )
        return self

    def pod_scheduler(self) -> str | None:
        """The schedulerName every pod of the job gets (None: the cluster's default)."""
        return self.scheduler_name or DEFAULT_SCHEDULERS.get(self.kind)
