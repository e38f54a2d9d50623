"""The scheduling section: where a job's pods may run, and how long the operator waits
for them (Kubernetes only)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlft.trainer.config.base import Section
from rlft.trainer.config.gang import GangSpec
from rlft.trainer.config.pods import DnsSubdomain, check_node_selector


class Toleration(Section):
    """A Kubernetes toleration."""

    key: str | None = None
    """Taint key to tolerate."""
    operator: Literal["Exists", "Equal"] | None = None
    """`Exists` or `Equal`."""
    value: str | None = None
    """Taint value (with `Equal`)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate."""
    toleration_seconds: int | None = Field(None, ge=0)
    """How long a NoExecute taint is tolerated."""

    @model_validator(mode="after")
    def _as_kubernetes_checks(self) -> Toleration:
        # The API server's own rules: a pod breaking them is refused at every create.
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value (it matches any)")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key needs operator: Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only")
        return self


class SchedulingSpec(Section):
    """Where pods may run (Kubernetes only)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels every pod requires."""

    @field_validator("node_selector")
    @classmethod
    def _node_labels(cls, values: dict[str, str]) -> dict[str, str]:
        return check_node_selector(values)

    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the pods tolerate."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """A Kubernetes affinity object, passed through unchanged."""
    priority_class_name: DnsSubdomain | None = None
    """PriorityClass of the pods."""
    scheduling_timeout_seconds: int = Field(600, ge=1, le=604800)
    """If the trainer gang is not scheduled within this time, say so in a condition."""
    node_lost_seconds: int = Field(60, ge=0, le=86400)
    """How long a pod stays on a node that stopped reporting (unreachable or not ready)
    before Kubernetes evicts it and the operator replaces it (the pods' NoExecute
    tolerations; Kubernetes' own default is 300). A pod still Terminating past its
    grace (its kubelet gone) is then force-deleted so its slot can be filled."""
    gang: GangSpec = GangSpec()
    """Gang scheduling and queueing: Kueue, Volcano or scheduler-plugins' coscheduling
    admit or place a group of the job's pods whole or not at all (which pods: `gang.kind`;
    default: none)."""
