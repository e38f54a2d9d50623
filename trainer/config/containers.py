"""What trainer and rollout pods share: the environment variables a job may add (and
those the operator keeps for itself), and resource requests and limits."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from rlft.trainer.config.base import Section
from rlft.trainer.config.pods import (
    ResourceQuantity,
    check_extended,
    check_requests_within_limits,
)

OPERATOR_ENV = frozenset(
    {
        "RLFT_JOB_NAME", "RLFT_NAMESPACE", "RLFT_POD_NAME", "RLFT_POD_UID", "RLFT_POD_IP",
        "RLFT_STATUS_PORT", "RLFT_TERMINATION_LOG", "RLFT_ROLLOUT_URLS", "HOME", "HF_HOME",
        "PYTHONUNBUFFERED",
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
        "AWS_REGION", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "RLFT_LIVENESS_PORT",
        "RLFT_GANG_ATTEMPT", "RLFT_JOB_UID", "RLFT_ROLLOUT_TOKEN", "RAY_AUTH_MODE",
        "RAY_AUTH_TOKEN", "RLFT_SECRET_ENV", "RLFT_SECRET_PATH",
    }
)  # fmt: skip
"""Variables the operator sets in its pods (RLFT_LIVENESS_PORT, RLFT_GANG_ATTEMPT and
RLFT_JOB_UID in trainer pods only, RAY_AUTH_* in Ray pods only): a job's own `env` may
not change them (the trainer, the rollout server and the operator agree on them)."""


class EnvVar(Section):
    """An environment variable of a role's containers (Kubernetes only)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)
    """Variable name, e.g. NCCL_DEBUG or HF_HUB_OFFLINE."""
    value: str | None = Field(None, max_length=65_536)
    """Its value (give this or valueFrom)."""
    value_from: dict[str, Any] | None = None
    """A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef,
    resourceFieldRef), passed to the pod unchanged."""

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"env {self.name}: give exactly one of value and valueFrom")
        if self.value_from is not None:
            problem = value_from_problem(self.value_from)
            if problem:
                raise ValueError(f"env {self.name}: valueFrom {problem}")
        if self.name in OPERATOR_ENV:
            raise ValueError(
                f"env {self.name} is set by the operator in every pod (the trainer, the "
                "rollout server and the operator depend on it); remove it from env"
            )
        return self


VALUE_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
FIELD_PATHS = (
    "metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName",
    "spec.serviceAccountName", "status.hostIP", "status.hostIPs", "status.podIP",
    "status.podIPs",
)  # fmt: skip
"""The pod fields the downward API gives variables (besides metadata.labels['KEY'] and
metadata.annotations['KEY']): the API server refuses a pod naming another."""


def value_from_problem(source: dict[str, Any]) -> str | None:
    """What the API server would refuse in an EnvVarSource (every pod create of the role
    would fail with a 422), in words; None when it is one it takes."""
    given = [k for k in VALUE_SOURCES if source.get(k) is not None]
    if len(given) != 1:
        return f"must have exactly one of {', '.join(VALUE_SOURCES)}"
    ref = source[given[0]]
    if not isinstance(ref, dict):
        return f"{given[0]} must be an object"
    if given[0] == "fieldRef":
        path = ref.get("fieldPath")
        subscripted = isinstance(path, str) and any(
            path.startswith(f"{p}['") and path.endswith("']") and len(path) > len(p) + 4
            for p in ("metadata.labels", "metadata.annotations")
        )
        if path not in FIELD_PATHS and not subscripted:
            return (
                f"fieldRef.fieldPath {path!r} is not a pod field variables can read: "
                f"{', '.join(FIELD_PATHS)}, metadata.labels['KEY'], metadata.annotations['KEY']"
            )
    elif given[0] == "resourceFieldRef":
        if not ref.get("resource"):
            return "resourceFieldRef needs resource (e.g. limits.cpu)"
    elif not ref.get("name") or not ref.get("key"):
        return f"{given[0]} needs name and key"
    return None


def unique_names(env: list[EnvVar]) -> list[EnvVar]:
    names = [e.name for e in env]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"env names must be unique; repeated: {', '.join(repeated)}")
    return env


class Resources(Section):
    """Kubernetes resource requests and limits of a pod's main container."""

    requests: dict[str, ResourceQuantity] = Field(default_factory=dict, max_length=64)
    """Requested resources, e.g. {cpu: "8", memory: 64Gi}."""
    limits: dict[str, ResourceQuantity] = Field(default_factory=dict, max_length=64)
    """Resource limits (each at least its request)."""
    extended: dict[str, Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        default_factory=dict, max_length=16
    )
    """Extended resources per pod, each both requested and limited (Kubernetes requires
    them equal), e.g. {rdma/hca_shared_devices_a: 1} or {vpc.amazonaws.com/efa: 32}. GPUs
    come from their own field; cpu and memory go in requests and limits."""

    @model_validator(mode="after")
    def _extended_names(self) -> Resources:
        check_extended(self.extended, {"requests": self.requests, "limits": self.limits})
        check_requests_within_limits(self.requests, self.limits)
        return self
