"""The status of an RLFineTune: what users read (`kubectl get rlft`) and what the operator
remembers between reconciles.

Everything the failure policy needs to decide (restart times in the window, the pods whose
failure was already counted, when the next restart may happen) lives here, in the custom
resource, not in the operator's memory: a restarted or newly elected operator continues
exactly where the previous one stopped.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import AliasGenerator, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]
TERMINAL_PHASES = ("Succeeded", "Failed")
ConditionType = Literal[
    "Scheduled", "Ready", "Progressing", "Checkpointed", "Healthy", "Created", "SpecApplied"
]
CONDITION_TYPES: tuple[str, ...] = ConditionType.__args__  # type: ignore[attr-defined]

MESSAGE_LENGTH = 1024
"""The most characters of a message (the job's, a condition's): the CRD's maxLength, past
which the API server refuses the whole status write."""


class _Status(BaseModel):
    model_config = ConfigDict(
        alias_generator=AliasGenerator(alias=to_camel),
        validate_by_name=True,
        validate_by_alias=True,
        extra="ignore",
        use_attribute_docstrings=True,
    )


class Condition(_Status):
    """One aspect of the job's state, Kubernetes style."""

    type: ConditionType
    """`Scheduled`: the trainer gang (replicas.min pods) is placed; `Ready`: all pods run;
    `Progressing`: steps advance; `Checkpointed`: a checkpoint was committed; `Healthy`:
    the collapse detector is content; `Created` (once the API server refused a child):
    False while it refuses one (QuotaExceeded, Forbidden, Invalid), True once created;
    `SpecApplied` (once an edit waited): False while an edit of the spec is not applied
    yet (SuspendToApply, Rescaling), True once it is."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = Field("", max_length=128)
    """One CamelCase word saying why."""
    message: str = Field("", max_length=MESSAGE_LENGTH)
    """Human-readable details."""
    last_transition_time: str | None = None
    """When `status` last changed (RFC 3339)."""


class CheckpointRef(_Status):
    """A committed checkpoint."""

    step: int = Field(ge=0)
    """Optimizer step the checkpoint holds."""
    uri: str = ""
    """Where it is (s3://… or file://…)."""
    time: str | None = None
    """When it was committed (RFC 3339)."""
    healthy: bool | None = None
    """The collapse detector's verdict at that step."""


class FailureRecord(_Status):
    """The most recent failure the operator handled."""

    reason: str
    """Failure kind: OOMKilled, Evicted, Preempted, NodeLost, Stalled, RendezvousTimeout, ImagePull,
    InvalidConfig, Collapsed, Error, TooManyRestarts, …"""
    pod: str = ""
    """The pod that failed (empty for job-level failures)."""
    time: str
    """When it was handled (RFC 3339)."""
    exit_code: int | None = None
    """The container's exit code, when it exited."""
    message: str = Field("", max_length=MESSAGE_LENGTH)
    """Details (the end of the container's termination message)."""
    action: str = ""
    """What the operator did about it."""


class CreateFailure(_Status):
    """The latest write of a child the API server refused, and when it is tried again."""

    kind: str
    """Pod, Service or ConfigMap."""
    name: str
    """The child's name."""
    reason: str
    """QuotaExceeded, Forbidden, Invalid, BadRequest or Refused."""
    code: int = Field(ge=100, le=599)
    """The HTTP status of the refusal (403, 422, …)."""
    message: str = Field("", max_length=MESSAGE_LENGTH)
    """The API server's message (e.g. `pods "x" is forbidden: exceeded quota: …`)."""
    attempts: int = Field(1, ge=1)
    """Refused writes in a row; the wait before the next one doubles with each."""
    retry_at: str
    """No child is created before this time (RFC 3339), unless the spec changes."""
    generation: int | None = None
    """The metadata.generation refused: an edit of the spec is tried at once."""


class RLFineTuneStatus(_Status):
    """Observed state of the job, written by the operator."""

    phase: Phase | None = None
    """Pending, Running, Restarting, Suspended, Succeeded or Failed."""
    message: str = Field("", max_length=MESSAGE_LENGTH)
    """One line on what the job is doing or why it stopped."""
    conditions: list[Condition] = Field(default_factory=list)
    """Scheduled, Ready, Progressing, Checkpointed, Healthy; Created and SpecApplied once
    they have something to say."""
    step: int | None = Field(None, ge=0)
    """Optimizer steps done (from the trainer's /status)."""
    policy_version: int | None = Field(None, ge=0)
    """Version of the policy the rollout instances serve."""
    reward: float | None = None
    """Mean reward of the latest step."""
    last_checkpoint: CheckpointRef | None = None
    """Newest committed checkpoint (never forgotten once known)."""
    last_healthy_checkpoint: CheckpointRef | None = None
    """Newest checkpoint the collapse detector called healthy: where rollbacks go."""
    restarts: int = Field(0, ge=0)
    """Pod restarts done by the operator since the job was created."""
    rollbacks: int = Field(0, ge=0)
    """Rollbacks to the last healthy checkpoint since the job was created."""
    last_failure: FailureRecord | None = None
    """The most recent failure and what was done about it."""
    observed_generation: int | None = None
    """The metadata.generation the job's children reflect: it moves only once an edit
    is applied (see the `SpecApplied` condition while one waits)."""
    restart_history: list[str] = Field(default_factory=list)
    """Times (RFC 3339) of the restarts inside restartPolicy.windowMinutes (bookkeeping)."""
    next_restart_at: str | None = None
    """No pod is recreated before this time (exponential backoff)."""
    handled_pods: list[str] = Field(default_factory=list)
    """UIDs of failed pods already counted, so a failure is never counted twice."""
    force_deleted: list[str] = Field(default_factory=list)
    """UIDs of pods force-deleted already: one Event each, however often the delete is
    repeated (a pod held by a finalizer stays)."""
    gang_pods: list[str] = Field(default_factory=list)
    """`name/uid` of the current trainer gang's pods once seen running: one that vanishes
    (deleted, evicted, its node lost) breaks the others, so the gang restarts."""
    gang_disruptions: list[str] = Field(default_factory=list)
    """`uid/reason` of the current gang's pods seen with a disruption condition (a
    preemption, a drain): one that vanishes before its end is seen is still judged a
    disruption, not counted against restartPolicy."""
    waiting_since: str | None = None
    """When the operator started waiting for the trainer gang to be scheduled."""
    resume: str = "auto"
    """The `--resume` argument of the next trainer start: `auto` until the job has a
    checkpoint of its own (each start takes spec.checkpoint.resume then), latest-healthy
    after (also once a suspended gang had trained: its emergency checkpoint)."""
    gang_attempt: int = Field(0, ge=0)
    """Trainer gangs restarted so far: new trainer pods meet at rendezvous
    `<uid>-<gangAttempt>`, so a restarted gang never joins the one its predecessor
    closed (whose host, the old trainer-0, may still be terminating)."""
    gang_replicas: str | None = Field(None, max_length=16)
    """`min:max` of the current trainer gang (its torchrun `--nnodes`): a different
    spec.trainer.replicas restarts the gang to apply it."""
    create_failure: CreateFailure | None = None
    """The latest refused create (quota, PodSecurity, an invalid object), until one
    succeeds: creates wait for its retryAt."""


def read_status(raw: object) -> tuple[RLFineTuneStatus, list[str]]:
    """The stored status, and the fields of it that did not parse (an operator downgraded
    past a condition type, a hand edit): those are dropped alone. Falling back to an
    empty status forgot the counted failures, the restart history and a terminal phase,
    and the next write stored that: failures counted again, a Failed job run again."""
    data = raw if isinstance(raw, dict) else {}
    try:
        return RLFineTuneStatus.model_validate(data), []
    except ValueError:
        pass
    kept: dict[str, object] = {}
    dropped: list[str] = []
    for key, value in data.items():
        try:
            RLFineTuneStatus.model_validate({key: value})
        except ValueError:
            if key != "conditions" or not isinstance(value, list):
                dropped.append(key)
                continue
            valid = [_valid_condition(c) for c in value]
            dropped += [f"conditions[{i}]" for i, ok in enumerate(valid) if not ok]
            kept[key] = [c for c, ok in zip(value, valid, strict=True) if ok]
        else:
            kept[key] = value
    return RLFineTuneStatus.model_validate(kept), dropped


def _valid_condition(value: object) -> bool:
    try:
        Condition.model_validate(value)
    except ValueError:
        return False
    return True


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def set_condition(
    st: RLFineTuneStatus, kind: str, status: str, reason: str, message: str, now: datetime
) -> bool:
    """Set a condition; True if its status changed (lastTransitionTime moves only then)."""
    for i, cond in enumerate(st.conditions):
        if cond.type == kind:
            changed = cond.status != status
            st.conditions[i] = Condition(
                type=kind,
                status=status,
                reason=reason,
                message=message[:MESSAGE_LENGTH],
                last_transition_time=rfc3339(now) if changed else cond.last_transition_time,
            )
            return changed
    st.conditions.append(
        Condition(
            type=kind,
            status=status,
            reason=reason,
            message=message[:MESSAGE_LENGTH],
            last_transition_time=rfc3339(now),
        )
    )
    return True


def condition(st: RLFineTuneStatus, kind: str) -> Condition | None:
    return next((c for c in st.conditions if c.type == kind), None)
