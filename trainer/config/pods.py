"""A role's own pod settings (`spec.trainer.pod`, `spec.rollout.pod`; Kubernetes only).

Typed fields, not a free-form pod template merged over the planner's pods: the CRD stays
structural (`kubectl explain rlft.spec.trainer.pod.volumes`), a bad value is refused with
its field named before any pod exists, and nothing the operator relies on can be
overridden by accident. What the operator owns stays its own: its volumes and mount
paths, its labels and annotations, and the hardening of every container (non-root,
read-only root filesystem, no privilege escalation, seccomp, all capabilities dropped but
the few listed in `capabilities`). Secrets and ConfigMaps are referenced by name, never
read. Why each choice: docs/architecture.md, "Pod settings per role".
"""

from __future__ import annotations

import re
import typing
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from rlft.trainer.config.base import Section

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_C_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"
# Kubernetes' resource.Quantity syntax (e.g. 100Gi, 1.5G, 500M).
_QUANTITY = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[kMGTPE]|[eE][+]?[0-9]+)?$"
# The same with the fractional suffixes (`500m` of a CPU), for resource requests/limits.
_RESOURCE_QUANTITY = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
QUANTITY_SUFFIXES = {
    **{s: Fraction(1024**i) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)},
    **{s: Fraction(1000**i) for i, s in enumerate(("k", "M", "G", "T", "P", "E"), 1)},
    "m": Fraction(1, 1000),
    "u": Fraction(1, 1_000_000),
    "n": Fraction(1, 1_000_000_000),
}
# A path segment that is neither `.` nor `..` (RE2 and Rust regex have no lookahead, and the
# same pattern goes into the CRD for the API server).
_SEGMENT = r"([^./][^/]*|\.[^./][^/]*|\.\.[^/]+)"
_ABSOLUTE_PATH = rf"^(/{_SEGMENT})+$"
_RELATIVE_PATH = rf"^{_SEGMENT}(/{_SEGMENT})*$"
# A label's or annotation's key: an optional DNS-subdomain prefix and a name (Kubernetes'
# qualified name); a label's value is empty or such a name; an extended resource's name
# must have the prefix.
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_DOMAIN = r"([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_QUALIFIED_NAME = re.compile(rf"^({_DOMAIN}/)?{_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_NAME})?$")
_EXTENDED_RESOURCE = re.compile(rf"^{_DOMAIN}/{_NAME}$")

OPERATOR_VOLUMES = frozenset({"job", "workspace", "tmp", "dshm"})
"""Volumes the operator gives every pod (the job file, the workspace, /tmp, /dev/shm)."""
OPERATOR_PATHS = ("/etc/rlft", "/workspace", "/tmp", "/dev/shm", "/dev/termination-log")
"""Where the operator mounts them, and where the kubelet puts the termination message the
failure policy reads: a job's own mount may be none of these, above one (it would hide
it) or inside one (the job file's folder is read-only; the others are scratch space whose
layout is the operator's)."""
OPERATOR_LABELS = frozenset(
    {
        "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
        "app.kubernetes.io/component",
    }
)  # fmt: skip
"""Label keys the operator sets on every pod (and selects by), besides `rlft.dev/…`."""
OPERATOR_PREFIX = "rlft.dev/"
"""Label and annotation keys under this prefix are the operator's."""
Capability = Literal["IPC_LOCK"]
"""Linux capabilities a job may add back (everything else stays dropped): IPC_LOCK lets
RDMA (InfiniBand, RoCE, EFA) pin the memory it registers. Nothing else a training or
serving process needs; each one more widens what a compromised pod can do."""
CAPABILITIES: tuple[str, ...] = typing.get_args(Capability)
ANNOTATIONS_BYTES = 256 * 1024
"""Kubernetes' limit on all of an object's annotations together (keys and values)."""


def _pattern(pattern: str, max_length: int) -> Any:
    """The pattern goes into the CRD (the API server checks it as well)."""
    return Field(min_length=1, max_length=max_length, json_schema_extra={"pattern": pattern})


def _matching(pattern: str, what: str) -> AfterValidator:
    """The same pattern in pydantic, with a message in words, not the regular expression."""
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise ValueError(f"{value!r} is not {what}")
        return value

    return AfterValidator(check)


DnsLabel = Annotated[
    str,
    _pattern(_DNS_LABEL, 63),
    _matching(_DNS_LABEL, "a DNS-1123 label (lower-case letters, digits and '-')"),
]
DnsSubdomain = Annotated[
    str,
    _pattern(_DNS_SUBDOMAIN, 253),
    _matching(_DNS_SUBDOMAIN, "a DNS-1123 subdomain (lower-case letters, digits, '-', '.')"),
]
AbsolutePath = Annotated[
    str,
    _pattern(_ABSOLUTE_PATH, 4096),
    _matching(_ABSOLUTE_PATH, "an absolute path without '.', '..', '//' or a trailing '/'"),
]
RelativePath = Annotated[
    str,
    _pattern(_RELATIVE_PATH, 4096),
    _matching(_RELATIVE_PATH, "a relative path without '.', '..', '//' or a trailing '/'"),
]
Quantity = Annotated[
    str, _pattern(_QUANTITY, 64), _matching(_QUANTITY, "a Kubernetes quantity such as 100Gi")
]


def _resource_quantity(value: str | int) -> str | int:
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{value} is negative")
    if isinstance(value, str) and not re.match(_RESOURCE_QUANTITY, value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity such as 500m, 8 or 64Gi")
    return value


# int or string in the CRD (x-kubernetes-int-or-string), as Kubernetes' own Quantity.
ResourceQuantity = Annotated[str | int, AfterValidator(_resource_quantity)]
EnvPrefix = Annotated[
    str,
    _pattern(_C_IDENTIFIER, 256),
    _matching(_C_IDENTIFIER, "a variable-name prefix (letters, digits and '_')"),
]


# --------------------------------------------------------------------------- volumes


class ClaimVolume(Section):
    """A PersistentVolumeClaim of the job's namespace, e.g. one holding the model."""

    claim_name: DnsSubdomain
    """Name of the claim."""
    read_only: bool = True
    """Attach the claim read-only, as models and datasets are; false for a cache the pods
    write (several pods share it: it needs a ReadWriteMany claim). Mounts of this volume
    are read-only unless this is false."""


class ConfigMapVolume(Section):
    """A ConfigMap's keys as files (read-only)."""

    name: DnsSubdomain
    """Name of the ConfigMap."""


class SecretVolume(Section):
    """A Secret's keys as files (read-only), e.g. for `spec.checkpoint.credentialsDir`;
    referenced by name, never read by the operator. What the files hold is scrubbed from
    the pods' logs and error texts, as secret variables are."""

    secret_name: DnsSubdomain
    """Name of the Secret."""


class EmptyDirVolume(Section):
    """Scratch space that lives as long as the pod, e.g. checkpoint staging on local disk."""

    medium: Literal["Memory"] | None = None
    """`Memory`: a tmpfs, counted against the container's memory. Unset: the node's disk."""
    size_limit: Quantity | None = None
    """Most it may hold, e.g. 200Gi (the kubelet evicts the pod past it)."""


_SOURCES = ("persistent_volume_claim", "config_map", "secret", "empty_dir")


class PodVolume(Section):
    """A volume of the role's pods, from exactly one source. No hostPath: it would give the
    pods the node's own files, which no Pod Security level short of privileged allows."""

    name: DnsLabel
    """Name that `volumeMounts` refer to."""
    persistent_volume_claim: ClaimVolume | None = None
    """A PersistentVolumeClaim (read-only unless its readOnly is false)."""
    config_map: ConfigMapVolume | None = None
    """A ConfigMap's keys as files (always read-only)."""
    secret: SecretVolume | None = None
    """A Secret's keys as files (always read-only), never read by the operator."""
    empty_dir: EmptyDirVolume | None = None
    """Scratch space living as long as the pod, on the node's disk or in memory."""

    @model_validator(mode="after")
    def _one_source(self) -> PodVolume:
        given = [s for s in _SOURCES if getattr(self, s) is not None]
        if len(given) != 1:
            raise ValueError(
                f"volume {self.name}: set exactly one source: persistentVolumeClaim, "
                "configMap, secret or emptyDir"
            )
        if self.name in OPERATOR_VOLUMES:
            raise ValueError(
                f"volume {self.name}: the operator's own volumes are named "
                f"{', '.join(sorted(OPERATOR_VOLUMES))}; choose another name"
            )
        return self

    def writable(self) -> bool:
        """Whether the source can be mounted read-write at all."""
        if self.persistent_volume_claim is not None:
            return not self.persistent_volume_claim.read_only
        return self.empty_dir is not None


class VolumeMount(Section):
    """Where one of the role's `volumes` appears in its containers."""

    name: DnsLabel
    """The volume, by its name in `volumes`."""
    mount_path: AbsolutePath
    """Absolute path in the container, e.g. /models. Not one of the operator's paths
    (/etc/rlft, /workspace, /tmp, /dev/shm), nor above or inside one."""
    read_only: bool | None = None
    """Mount read-only. Unset: read-only, except an emptyDir and a claim whose readOnly is
    false."""
    sub_path: RelativePath | None = None
    """A folder of the volume to mount instead of its root, e.g. models/qwen3."""


def _clash(path: str) -> str | None:
    """How a mount path collides with the operator's own, if it does."""
    for own in OPERATOR_PATHS:
        if path == own:
            return f"is the operator's own {own}"
        if path.startswith(own + "/"):
            return f"is inside the operator's {own}"
        if own.startswith(path + "/"):
            return f"would hide the operator's {own}"
    return None


# ------------------------------------------------------------------ the rest of a pod


class LocalRef(Section):
    """A ConfigMap or Secret of the job's namespace, by name."""

    name: DnsSubdomain
    """Its name."""
    optional: bool = False
    """Start the pods even when it does not exist."""


class EnvFromSource(Section):
    """Every key of one ConfigMap or Secret as an environment variable. Variables the
    operator or `env` set take precedence (Kubernetes' rule), so the operator's stay."""

    config_map_ref: LocalRef | None = None
    """The ConfigMap (give this or secretRef)."""
    secret_ref: LocalRef | None = None
    """The Secret (give this or configMapRef); never read by the operator."""
    prefix: EnvPrefix | None = None
    """Put before each key to make the variable's name."""

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        if (self.config_map_ref is None) == (self.secret_ref is None):
            raise ValueError("give exactly one of configMapRef and secretRef")
        return self


class PullSecret(Section):
    """A Secret of type kubernetes.io/dockerconfigjson in the job's namespace."""

    name: DnsSubdomain
    """Name of the Secret."""


def _check_qualified(key: str, what: str) -> None:
    prefix, _, name = key.rpartition("/")
    if not _QUALIFIED_NAME.match(key) or len(name) > 63 or len(prefix) > 253:
        raise ValueError(
            f"{what} key {key!r} is not a qualified name: an optional DNS-subdomain "
            "prefix and '/', then at most 63 letters, digits, '-', '_' or '.'"
        )


def _check_label_value(key: str, value: str) -> None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ValueError(
            f"label {key}: value {value!r} is not a label value: at most 63 letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit"
        )


def check_node_selector(values: dict[str, str]) -> dict[str, str]:
    """Node labels: qualified keys, label values (the API server refuses a pod otherwise,
    and every create of the job's pods would fail)."""
    for key, value in values.items():
        _check_qualified(key, "nodeSelector")
        _check_label_value(key, value)
    return values


def _check_keys(values: dict[str, str], what: str, label_values: bool) -> dict[str, str]:
    for key, value in values.items():
        _check_qualified(key, what)
        if key in OPERATOR_LABELS or key.startswith(OPERATOR_PREFIX):
            raise ValueError(
                f"{what} key {key!r} is the operator's (it sets and selects pods by "
                f"{OPERATOR_PREFIX}… and app.kubernetes.io/name, instance, managed-by and "
                "component); choose another key"
            )
        if label_values:
            _check_label_value(key, value)
    return values


class PodCustomisation(Section):
    """The role's own pod settings, added to what the operator builds (Kubernetes only).
    The operator's volumes, variables, labels and hardening stay; see docs/architecture.md
    ("Pod settings per role")."""

    volumes: list[PodVolume] = Field(default_factory=list, max_length=64)
    """Volumes of the role's pods: persistentVolumeClaim, configMap, secret or emptyDir."""
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=64)
    """Mounts of those volumes into the role's containers."""
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=32)
    """ConfigMaps and Secrets whose keys become environment variables."""
    image_pull_secrets: list[PullSecret] = Field(default_factory=list, max_length=16)
    """Secrets with the registry credentials to pull the role's image."""
    service_account_name: DnsSubdomain | None = None
    """ServiceAccount of the pods, e.g. one bound to a cloud role for object-store access
    (IRSA, Workload Identity). Unset: the namespace's `default`."""
    automount_service_account_token: bool = False
    """Mount the ServiceAccount's Kubernetes API token. Off by default: nothing in the pods
    calls the API, and the IRSA and EKS Pod Identity webhooks inject tokens of their own."""
    runtime_class_name: DnsSubdomain | None = None
    """RuntimeClass of the pods, e.g. `nvidia` where the NVIDIA container runtime is not
    the node's default."""
    labels: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Extra labels of the role's pods (not the operator's own keys)."""
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64)
    """Extra annotations of the role's pods, e.g. a Multus network for RDMA or
    cluster-autoscaler.kubernetes.io/safe-to-evict: "false" (not rlft.dev/ keys)."""
    capabilities: list[Capability] = Field(default_factory=list, max_length=len(CAPABILITIES))
    """Linux capabilities added to the containers' (all others stay dropped): IPC_LOCK,
    for RDMA's memory registration. A non-root process keeps it only where the runtime
    passes it on; the memlock limit the node's runtime gives containers is what RDMA
    needs in practice (docs/architecture.md)."""

    @field_validator("labels")
    @classmethod
    def _label_syntax(cls, labels: dict[str, str]) -> dict[str, str]:
        return _check_keys(labels, "label", label_values=True)

    @field_validator("annotations")
    @classmethod
    def _annotation_syntax(cls, annotations: dict[str, str]) -> dict[str, str]:
        _check_keys(annotations, "annotation", label_values=False)
        size = sum(len(k) + len(v) for k, v in annotations.items())
        if size > ANNOTATIONS_BYTES:
            raise ValueError(f"annotations hold {size} bytes; Kubernetes allows 262144")
        return annotations

    @model_validator(mode="after")
    def _mounts_fit(self) -> PodCustomisation:
        _unique([v.name for v in self.volumes], "volumes: volume names")
        _unique([m.mount_path for m in self.volume_mounts], "volumeMounts: mount paths")
        _unique(self.capabilities, "capabilities")
        declared = {v.name: v for v in self.volumes}
        for i, mount in enumerate(self.volume_mounts):
            where = f"volumeMounts[{i}]"
            volume = declared.get(mount.name)
            if volume is None:
                raise ValueError(f"{where}.name: no volume named {mount.name} in volumes")
            clash = _clash(mount.mount_path)
            if clash:
                raise ValueError(
                    f"{where}.mountPath: {mount.mount_path} {clash}; mount elsewhere "
                    "(e.g. /models, /data, /cache)"
                )
            if mount.read_only is False and not volume.writable():
                fix = (
                    "set its persistentVolumeClaim.readOnly: false to write to it"
                    if volume.persistent_volume_claim
                    else "configMap and secret volumes always are"
                )
                raise ValueError(f"{where}.readOnly: volume {volume.name} is read-only; {fix}")
        return self

    def mount_read_only(self, mount: VolumeMount) -> bool:
        """A mount's readOnly: as given, else read-only unless its volume is writable."""
        if mount.read_only is not None:
            return mount.read_only
        volume = next(v for v in self.volumes if v.name == mount.name)
        return not volume.writable()


def _unique(values: list[str], what: str) -> None:
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{what} must be unique; repeated: {', '.join(repeated)}")


def quantity(value: str | int | float) -> Fraction:
    """A Kubernetes quantity (`500m`, `64Gi`, `1e3`, 8) as an exact number."""
    if isinstance(value, int | float):
        return Fraction(value)
    text = value.strip()
    for suffix in sorted(QUANTITY_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix) and suffix != text:
            return Fraction(text[: -len(suffix)]) * QUANTITY_SUFFIXES[suffix]
    return Fraction(text)  # plain or with an exponent (`1e3`)


def check_requests_within_limits(
    requests: dict[str, str | int], limits: dict[str, str | int]
) -> None:
    """What the API server refuses in a pod (422): a request above its limit."""
    for name in sorted(requests.keys() & limits.keys()):
        if quantity(requests[name]) > quantity(limits[name]):
            raise ValueError(
                f"requests.{name} ({requests[name]}) is above limits.{name} "
                f"({limits[name]}); Kubernetes refuses such a pod: lower the request or "
                "raise the limit"
            )


def check_extended(extended: dict[str, int], given: dict[str, dict[str, str | int]]) -> None:
    """`resources.extended`: fully qualified names outside kubernetes.io, and none that has
    its own field or is already in `requests` or `limits` (`given`)."""
    for key in extended:
        domain = key.partition("/")[0]
        if not _EXTENDED_RESOURCE.match(key) or domain.endswith(("kubernetes.io", "k8s.io")):
            raise ValueError(
                f"extended: {key!r} is not an extended resource: a domain outside "
                "kubernetes.io, '/', and a name, e.g. rdma/hca_shared_devices_a or "
                "vpc.amazonaws.com/efa (cpu, memory and the like go in requests and limits)"
            )
        if key == "nvidia.com/gpu":
            raise ValueError(
                "extended: nvidia.com/gpu comes from gpusPerPod (trainer) or "
                "gpusPerInstance (rollout); remove it here"
            )
        for field, values in given.items():
            if key in values:
                raise ValueError(f"extended: {key} is also in {field}; give it once")
