"""What one reconcile sees and decides: the operator's state machine (reconcile.py) takes
`Observed` and returns a `Decision`, which handlers.py applies to the API server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rlft.operator import failures as P
from rlft.operator.observe import PodView, TrainerReport
from rlft.operator.status import FailureRecord, rfc3339
from rlft.operator.status import RLFineTuneStatus as Status


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the RLFineTune: one per decision."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """What exists now."""

    pods: list[PodView] = field(default_factory=list)
    config_maps: frozenset[str] = frozenset()
    services: frozenset[str] = frozenset()
    report: TrainerReport | None = None
    config_data: Mapping[str, str] = field(default_factory=dict)
    """The job file in each ConfigMap (by name), where known."""
    oom_killed: list[PodView] = field(default_factory=list)
    """Pods seen OOM-killed lately, gone ones too: a deleted pod's final status (how its
    containers ended) comes just before its delete, so the pods above may never show it."""


@dataclass
class Decision:
    status: Status
    create: list[dict[str, Any]] = field(default_factory=list)
    update: list[dict[str, Any]] = field(default_factory=list)
    """ConfigMaps to re-render (their `data` replaces the stored one), before any create."""
    delete_pods: list[str] = field(default_factory=list)
    force_delete_pods: list[str] = field(default_factory=list)
    """Pods still Terminating STUCK_TERMINATING_SECONDS (responses.py) past their grace:
    their kubelet is gone (a lost node), so only a force deletion frees the slot."""
    events: list[Event] = field(default_factory=list)
    set_suspend: bool = False
    """Ask for spec.suspend=true (a collapse with onCollapse=suspend): the user resumes."""
    requeue_after: float | None = None
    """Reconcile again after this many seconds even if nothing changes."""


def invalid_spec(
    status: Status,
    problems: list[str],
    now: datetime,
    pods: Sequence[PodView] = (),
    suspend: bool = False,
) -> Decision:
    """A custom resource the API server accepted but pydantic rejects (the CRD cannot say
    everything; a stricter operator after an upgrade): fail it once, naming every field,
    and free what its pods hold, as every failed job does. A finished job is left as it
    is (an edit never runs it again), and a suspended one stays suspended until the spec
    is fixed: the edit is what is wrong, not the run its checkpoints hold. So is one whose
    `spec.suspend` the operator has not acted on yet (`suspend`): the user suspended it,
    then made the edit that the CRD allows only while suspended."""
    st = status.model_copy(deep=True)
    failed_otherwise = st.phase == "Failed" and (
        st.last_failure is None or st.last_failure.reason != P.INVALID_CONFIG
    )
    if st.phase == "Succeeded" or failed_otherwise:
        return Decision(status=st)
    message = "invalid spec: " + "; ".join(problems)
    d = Decision(status=st, delete_pods=sorted(p.name for p in pods if p.active))
    if st.phase == "Suspended" or suspend:
        st.phase = "Suspended"
        held = f"{message}; fix the spec before resuming"[:1024]
        if st.message != held:
            d.events.append(Event("Warning", "InvalidSpec", held))
        st.message = held
        return d
    if st.phase != "Failed" or st.message != message[:1024]:
        d.events.append(Event("Warning", "InvalidSpec", message[:1024]))
    st.phase = "Failed"
    st.message = message[:1024]
    st.last_failure = FailureRecord(
        reason=P.INVALID_CONFIG, time=rfc3339(now), message=message[:1024], action="fail the job"
    )
    return d
