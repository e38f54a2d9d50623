"""What the operator sees: raw pod objects and the trainer's /status reduced to plain data.

Only the facts the failure policy and the phase machine use are kept, so those can be
tested with hand-written values and hypothesis without building whole pod objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlft.operator import names as N
from rlft.trainer.api_token import TOKEN_ENV
from rlft.trainer.termination import Verdict
from rlft.trainer.termination import read as read_verdict

KUEUE_STOP = "TerminationTarget"
"""The condition Kueue sets on each pod of a workload it stops (evicted for a
preemption, past its PodsReady timeout, deleted) before deleting it; its reason is
StoppedByKueue in older releases, the stop's (WorkloadEvictedDueToPreempted, …) in newer
ones. Reported as the disruption `TerminationTarget/<reason>`."""


@dataclass(frozen=True)
class PodView:
    """One observed pod."""

    name: str
    uid: str
    role: str
    index: int
    phase: str = "Pending"
    """Pending, Running, Succeeded, Failed or Unknown."""
    reason: str = ""
    """The pod-level reason (Evicted, NodeLost, Preempting, UnexpectedAdmissionError, …)."""
    status_message: str = ""
    """The pod-level message (why it was evicted or refused)."""
    scheduled: bool = False
    scheduled_at: str | None = None
    """When the pod got its node (PodScheduled's lastTransitionTime)."""
    deleting: bool = False
    deletion_deadline: str | None = None
    """metadata.deletionTimestamp: when the pod's grace period ends."""
    created: str | None = None
    pod_ip: str | None = None
    exit_code: int | None = None
    """Exit code of the main container, once it terminated."""
    terminated_reason: str = ""
    """OOMKilled, Error, Completed, ContainerCannotRun, …"""
    finished_at: str | None = None
    """When the main container terminated (its node's clock, as its kubelet reports it)."""
    message: str = ""
    """Termination message (the end of the log with FallbackToLogsOnError): matched for
    known failures, never copied into the status."""
    verdict: Verdict | None = None
    """What the process itself reported in its termination message (trainer/termination.py)."""
    waiting_reason: str = ""
    """ErrImagePull, ImagePullBackOff, InvalidImageName, CreateContainerConfigError, …"""
    waiting_message: str = ""
    disruption: str = ""
    """Reason of a DisruptionTarget=True condition (PreemptionByScheduler, …), or
    `TerminationTarget/<reason>` for Kueue's TerminationTarget=True."""
    unschedulable: str = ""
    """Message of PodScheduled=False (why the scheduler cannot place it)."""
    gated: bool = False
    """Held by scheduling gates (Kueue's admission): queued, not unschedulable. The API
    server sets PodScheduled=False, reason SchedulingGated, on such a pod's creation."""
    ready: bool | None = None
    """The Ready condition (None before the pod has one)."""
    rollout_token: bool = True
    """Its main container is given the job's rollout token. Pods made by an operator from
    before tokens are not: their trainers call the rollout API without one."""

    @property
    def on_lost_node(self) -> bool:
        """Evicted from a node that stopped reporting: the taint manager deleted it after
        its nodeLostSeconds of tolerating the unreachable or not-ready taint, and the node
        lifecycle controller had marked it not ready (a live kubelet keeps a pod it is
        still stopping ready). No kubelet will finish its deletion or report its end."""
        return self.deleting and self.disruption == "DeletionByTaintManager" and self.ready is False

    @property
    def active(self) -> bool:
        """Still holds (or may still hold) resources on a node."""
        return not self.deleting and self.phase in ("Pending", "Running", "Unknown")

    @property
    def running(self) -> bool:
        return not self.deleting and self.phase == "Running"


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in pod.get("status", {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None


def _disruption(pod: dict[str, Any]) -> str:
    """Why the cluster is taking the pod: DisruptionTarget's reason, else
    `TerminationTarget/<reason>` (Kueue sets that condition, not DisruptionTarget, on each
    pod of a workload it stops, before deleting them)."""
    cond = _condition(pod, "DisruptionTarget")
    if cond is not None and cond.get("status") == "True":
        return cond.get("reason") or "DisruptionTarget"
    cond = _condition(pod, KUEUE_STOP)
    if cond is not None and cond.get("status") == "True":
        return f"{KUEUE_STOP}/{cond.get('reason') or 'Stopped'}"
    return ""


def _given_token(pod: dict[str, Any]) -> bool:
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == "main":
            return any(e.get("name") == TOKEN_ENV for e in container.get("env") or [])
    return False


def pod_view(pod: dict[str, Any]) -> PodView | None:
    """The view of a raw pod, or None if it is not one of ours (no role/index labels)."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    role = labels.get(N.LABEL_ROLE)
    try:
        index = int(labels.get(N.LABEL_INDEX, ""))
    except ValueError:
        return None
    if role not in N.ROLES:
        return None
    status = pod.get("status") or {}
    scheduled_cond = _condition(pod, "PodScheduled")
    scheduled = bool(pod.get("spec", {}).get("nodeName")) or (
        scheduled_cond is not None and scheduled_cond.get("status") == "True"
    )
    scheduled_at = None
    if scheduled_cond is not None and scheduled_cond.get("status") == "True":
        scheduled_at = scheduled_cond.get("lastTransitionTime")
    unschedulable = ""
    gated = bool(pod.get("spec", {}).get("schedulingGates"))
    if scheduled_cond is not None and scheduled_cond.get("status") == "False":
        if scheduled_cond.get("reason") == "SchedulingGated":
            gated = True
        else:
            unschedulable = scheduled_cond.get("message") or scheduled_cond.get("reason") or ""
    disruption = _disruption(pod)
    ready_cond = _condition(pod, "Ready")
    ready = None if ready_cond is None else ready_cond.get("status") == "True"
    exit_code, terminated_reason, message, finished_at = None, "", "", None
    waiting_reason, waiting_message = "", ""
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") != "main":
            continue
        state = cs.get("state") or {}
        term = state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if term:
            exit_code = term.get("exitCode")
            terminated_reason = term.get("reason") or ""
            message = term.get("message") or ""
            finished_at = term.get("finishedAt")
        waiting = state.get("waiting")
        if waiting:
            waiting_reason = waiting.get("reason") or ""
            waiting_message = waiting.get("message") or ""
    return PodView(
        rollout_token=_given_token(pod),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=role,
        index=index,
        phase=status.get("phase") or "Pending",
        reason=status.get("reason") or "",
        status_message=(status.get("message") or "")[-500:],
        scheduled=scheduled,
        scheduled_at=scheduled_at,
        deleting=bool(meta.get("deletionTimestamp")),
        deletion_deadline=meta.get("deletionTimestamp"),
        created=meta.get("creationTimestamp"),
        pod_ip=status.get("podIP"),
        exit_code=exit_code,
        terminated_reason=terminated_reason,
        finished_at=finished_at,
        message=message[-2000:],
        verdict=read_verdict(message),
        waiting_reason=waiting_reason,
        waiting_message=waiting_message[-500:],
        disruption=disruption,
        unschedulable=unschedulable[-500:],
        gated=gated and not scheduled,
        ready=ready,
    )


@dataclass(frozen=True)
class TrainerReport:
    """The trainer's /status document (docs/architecture.md), as polled from one pod."""

    pod_uid: str
    step: int | None = None
    policy_version: int | None = None
    phase: str = ""
    health: str = "ok"
    reward: float | None = None
    last_checkpoint: dict[str, Any] | None = None
    last_healthy_checkpoint: dict[str, Any] | None = None
    rollbacks: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)


def _finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _checkpoint(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict) or _int(value.get("step")) is None:
        return None
    out = {"step": value["step"], "uri": str(value.get("uri") or "")}
    if isinstance(value.get("time"), str):
        out["time"] = value["time"]
    if isinstance(value.get("healthy"), bool):
        out["healthy"] = value["healthy"]
    return out


def trainer_report(document: Any, pod_uid: str) -> TrainerReport | None:
    """Parse a /status document; None if it is not one (a trainer that is not rank 0, a
    proxy's error page, …), or another pod's (its `podUid` is not `pod_uid`: a pod's address
    reused while an older pod still serves there). Unknown or malformed fields are dropped,
    never trusted; a document without `podUid` (a trainer from before it) is believed."""
    if not isinstance(document, dict) or "step" not in document:
        return None
    if document.get("podUid") not in (None, pod_uid):
        return None
    health = document.get("health")
    reward = document.get("reward")
    return TrainerReport(
        pod_uid=pod_uid,
        step=_int(document.get("step")),
        policy_version=_int(document.get("policyVersion")),
        phase=str(document.get("phase") or ""),
        health=health if health in ("ok", "warning", "collapsed") else "ok",
        # NaN or ±inf (Python's json reads them) would make every status patch invalid
        # JSON: the API server refuses it, and the job would not reconcile until it changed.
        reward=float(reward) if _finite_number(reward) else None,
        last_checkpoint=_checkpoint(document.get("lastCheckpoint")),
        last_healthy_checkpoint=_checkpoint(document.get("lastHealthyCheckpoint")),
        rollbacks=_int(document.get("rollbacks")),
        events=[e for e in document.get("events") or [] if isinstance(e, dict)][-20:],
    )
