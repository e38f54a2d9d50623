"""The Helm chart's values, as pydantic models: the single source of `values.yaml` (defaults
and comments) and `values.schema.json` (types, bounds, unknown keys rejected).

Where a value maps to an operator option its default is the operator's own
(`python -m rlft.operator --help`), from `rlft.operator.options`, so the chart and the
operator cannot drift apart. `python -m rlft.operator.chart_files` writes both files; a
test fails when they are stale.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AliasGenerator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from rlft.operator import options

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Prometheus durations, as prometheus-operator's CRDs accept them.
DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
DURATION_MS |= {"w": 7 * DURATION_MS["d"], "y": 365 * DURATION_MS["d"]}
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"
LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"

Labels = dict[str, str]
LabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY, max_length=317)]
Selector = dict[LabelKey, str]
Namespace = Annotated[str, StringConstraints(pattern=DNS_LABEL, max_length=63)]
Quantity = Annotated[str, StringConstraints(pattern=QUANTITY)]
Port = Annotated[int, Field(ge=1, le=65535)]
ResourceName = Literal["cpu", "memory", "ephemeral-storage"]


def milliseconds(duration: str) -> int:
    """A Prometheus duration (`1m30s`, `500ms`) in milliseconds."""
    return sum(int(n) * DURATION_MS[u] for n, u in re.findall(r"([0-9]+)(ms|[smhdwy])", duration))


class Values(BaseModel):
    """Base of every values section: camelCase keys as in Kubernetes, unknown keys rejected."""

    model_config = ConfigDict(
        alias_generator=AliasGenerator(alias=to_camel),
        validate_by_name=True,
        validate_by_alias=True,
        strict=True,  # as JSON schema: "yes" is not a boolean, "2" not a number
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )


class Image(Values):
    """The operator's container image (built from operator/Dockerfile)."""

    repository: str = Field("ghcr.io/rlft/operator", min_length=1, max_length=255)
    """Image repository (no tag)."""
    tag: str = Field("", max_length=128, pattern=r"^([\w][\w.-]*)?$")
    """Image tag; empty: the chart's appVersion (the rlft version)."""
    digest: str = Field("", pattern=r"^(sha256:[a-f0-9]{64})?$")
    """Pin the image by digest (`sha256:…`); wins over `tag` when set."""
    pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    """When the kubelet pulls the image."""


class PullSecret(Values):
    """A Secret with registry credentials, in the release namespace."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the Secret."""


class OperatorOptions(Values):
    """Command-line options of `python -m rlft.operator` (defaults: the operator's own)."""

    peering: str = Field(options.PEERING, min_length=1, max_length=63, pattern=DNS_LABEL)
    """Name of the kopf peering object the replicas elect their leader through."""
    peering_lifetime_seconds: int = Field(options.PEERING_LIFETIME_SECONDS, ge=5, le=3600)
    """Seconds a silent replica still counts as alive: how long a standby waits before it
    takes over from a leader that vanished without saying goodbye."""
    poll_seconds: float = Field(options.POLL_SECONDS, ge=1, le=3600)
    """Every job is reconciled (and its trainer's /status polled) at least this often."""
    trainer_status_port: int = Field(options.TRAINER_STATUS_PORT, ge=1024, le=65535)
    """Port of the trainers' /status and /metrics (the operator polls it)."""
    rendezvous_port: int = Field(options.RENDEZVOUS_PORT, ge=1024, le=65535)
    """Port of torchrun's rendezvous store on each job's trainer pod 0."""
    rollout_port: int = Field(options.ROLLOUT_PORT, ge=1024, le=65535)
    """Port of the rollout pods' protocol (/generate, /weights, /healthz, /metrics)."""
    liveness_port: int = Field(options.LIVENESS_PORT, ge=1024, le=65535)
    """Port of each trainer pod's /livez (jobs with trainer.stallTimeoutSeconds)."""
    ray_port: int = Field(options.RAY_PORT, ge=1024, le=65535)
    """Port of the Ray head of a rollout instance that spans several nodes."""
    grace_seconds: int = Field(options.GRACE_SECONDS, ge=0, le=86400)
    """terminationGracePeriodSeconds of the rollout pods. Trainer pods get their job's
    spec.checkpoint.gracePeriodSeconds (the emergency checkpoint's time) plus a margin."""
    job_network_policy: bool = True
    """A NetworkPolicy per job: its pods take connections from each other, and from
    elsewhere only on the trainer status, rollout and liveness ports (false where
    something else must reach another port of them, e.g. a sidecar's)."""
    metrics_port: int = Field(options.metrics_port(), ge=1024, le=65535)
    """Port of the operator's /metrics (also its liveness and readiness probe)."""
    verbose: bool = False
    """Debug logging."""


class ServiceAccount(Values):
    """The operator's ServiceAccount."""

    create: bool = True
    """Create it (false: use an existing one named `name`)."""
    name: str = Field("", max_length=253)
    """Its name; empty: the release's full name."""
    annotations: Labels = Field(default_factory=dict)
    """Annotations, e.g. for workload identity."""


class Rbac(Values):
    """Roles of the operator: exactly what `rlft.operator.permissions` declares."""

    create: bool = True
    """Create the Roles/ClusterRoles and their bindings."""
    gang_scheduling: bool = False
    """Also let the operator create and patch the PodGroups of jobs whose
    spec.scheduling.gang.kind is `volcano` (scheduling.volcano.sh) or `coscheduling`
    (scheduling.x-k8s.io); off: such a job's pods are not created, and its status says
    the API server forbade the PodGroup. Kueue needs no permission of the operator."""


class Resources(Values):
    """Resource requests and limits of the operator container."""

    requests: dict[ResourceName, Quantity] = Field(
        default_factory=lambda: {"cpu": "100m", "memory": "128Mi"}
    )
    """Requested resources (quantities, e.g. `100m`, `128Mi`)."""
    limits: dict[ResourceName, Quantity] = Field(default_factory=lambda: {"memory": "512Mi"})
    """Limits; the operator's memory grows with the number of jobs (≈90 MiB at 200)."""


class SecurityContext(Values):
    """The operator's user; the rest of the security context is fixed (non-root, read-only
    root filesystem, no privilege escalation, all capabilities dropped, seccomp)."""

    run_as_user: int = Field(1000, ge=1, le=2**31 - 1)
    """UID the container runs as (never 0)."""
    run_as_group: int = Field(1000, ge=1, le=2**31 - 1)
    """GID the container runs as (never 0)."""


class Monitor(Values):
    """A prometheus-operator scrape object (needs its CRDs in the cluster)."""

    enabled: bool = False
    """Render it."""
    interval: str = Field("30s", pattern=DURATION)
    """Scrape interval."""
    scrape_timeout: str = Field("10s", pattern=DURATION)
    """Scrape timeout (at most the interval)."""
    labels: Labels = Field(default_factory=dict)
    """Extra labels, e.g. the `release` label your Prometheus selects monitors by."""

    @model_validator(mode="after")
    def _timeout_within_interval(self) -> Monitor:
        # prometheus-operator drops a monitor whose timeout is longer (Prometheus refuses
        # the scrape); the chart's templates refuse it too (rlft.checkScrape).
        timeout, interval = self.scrape_timeout, self.interval
        if timeout and interval and milliseconds(timeout) > milliseconds(interval):
            raise ValueError(f"scrapeTimeout {timeout} is longer than interval {interval}")
        return self


class Metrics(Values):
    """Scraping the operator's /metrics (a ClusterIP Service always exposes it)."""

    service_monitor: Monitor = Monitor()
    """A ServiceMonitor for the operator's Service."""
    pod_monitor: Monitor = Monitor()
    """A PodMonitor for the operator's pods (instead of, or besides, the ServiceMonitor)."""


class JobMetrics(Values):
    """Scraping the training jobs' pods: trainers (`status` port) and rollout instances
    (`http` port) serve /metrics."""

    pod_monitor: Monitor = Monitor(interval="15s")
    """A PodMonitor for every pod the operator creates, in the served namespaces."""


class PrometheusRule(Values):
    """Alert rules of observability/rules/ (collapse, gradient spikes, stale checkpoints,
    restart storms, rollout engines down…) as a PrometheusRule."""

    enabled: bool = False
    """Render it (needs prometheus-operator's CRDs)."""
    labels: Labels = Field(default_factory=dict)
    """Extra labels, e.g. the one your Prometheus selects rules by."""


class GrafanaDashboard(Values):
    """The dashboards of observability/grafana/ as ConfigMaps for Grafana's sidecar."""

    enabled: bool = False
    """Render them."""
    namespace: str = Field("", max_length=63, pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$")
    """Namespace of the ConfigMaps (where Grafana's sidecar looks); empty: the release's."""
    labels: Labels = Field(default_factory=lambda: {"grafana_dashboard": "1"})
    """Labels the sidecar selects dashboards by."""
    annotations: Labels = Field(default_factory=dict)
    """Annotations, e.g. the sidecar's folder annotation."""


class ApiServer(Values):
    """Where the operator may connect to the Kubernetes API server."""

    ports: list[Port] = Field(default_factory=lambda: [443, 6443], min_length=1)
    """TCP ports of the API server (the Service's and the endpoints')."""
    cidrs: list[str] = Field(default_factory=list)
    """CIDRs of the API server endpoints; empty: any address."""


class NetworkPolicy(Values):
    """A NetworkPolicy for the operator pods: in, only /metrics; out, only DNS, the API
    server and the trainers' /status."""

    enabled: bool = False
    """Render it."""
    api_server: ApiServer = ApiServer()
    """The API server's address and ports."""
    metrics_from: list[dict[str, Any]] = Field(default_factory=list)
    """NetworkPolicy peers allowed to scrape /metrics (e.g. a namespaceSelector for your
    monitoring namespace); empty: any."""


class PodDisruptionBudget(Values):
    """Keeps one replica (the leader or its standby) up during voluntary disruptions."""

    enabled: bool = True
    """Render it."""
    max_unavailable: int = Field(1, ge=1, le=10)
    """Replicas a drain may take down at once."""


class ChartValues(Values):
    """Values of the rlft chart: the RLFineTune operator and its optional monitoring."""

    image: Image = Image()
    """The operator image."""
    image_pull_secrets: list[PullSecret] = Field(default_factory=list)
    """Secrets for pulling the operator image."""
    replicas: int = Field(2, ge=1, le=5)
    """Operator replicas: one leads (kopf peering), the others stand by and take over."""
    watch_namespaces: list[Namespace] = Field(default_factory=list, max_length=100)
    """Namespaces whose RLFineTunes the operator serves, with a Role in each; empty: all
    namespaces, with a ClusterRole."""
    operator: OperatorOptions = OperatorOptions()
    """Options of the operator process."""
    service_account: ServiceAccount = ServiceAccount()
    """The operator's ServiceAccount."""
    rbac: Rbac = Rbac()
    """The operator's RBAC."""
    resources: Resources = Resources()
    """Requests and limits of the operator container."""
    security_context: SecurityContext = SecurityContext()
    """The operator's UID and GID."""
    node_selector: Selector = Field(default_factory=dict)
    """Node labels the operator pods require."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Tolerations of the operator pods (Kubernetes Toleration objects)."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Affinity of the operator pods; empty: prefer spreading replicas over nodes."""
    priority_class_name: str = Field("", max_length=253)
    """PriorityClass of the operator pods."""
    pod_annotations: Labels = Field(default_factory=dict)
    """Extra annotations of the operator pods."""
    pod_labels: Selector = Field(default_factory=dict)
    """Extra labels of the operator pods."""
    metrics: Metrics = Metrics()
    """Scraping the operator."""
    job_metrics: JobMetrics = JobMetrics()
    """Scraping the training jobs."""
    prometheus_rule: PrometheusRule = PrometheusRule()
    """Alert rules."""
    grafana_dashboard: GrafanaDashboard = GrafanaDashboard()
    """Grafana dashboards."""
    network_policy: NetworkPolicy = NetworkPolicy()
    """Network isolation of the operator pods."""
    pod_disruption_budget: PodDisruptionBudget = PodDisruptionBudget()
    """Disruption budget of the operator pods."""

    @field_validator("watch_namespaces")
    @classmethod
    def _unique(cls, namespaces: list[str]) -> list[str]:
        if len(set(namespaces)) != len(namespaces):
            raise ValueError("each namespace once: a second Role of the same name fails")
        return namespaces


def _tighten(node: Any) -> Any:
    """Drop pydantic's titles (noise in a values schema), and turn a constrained key type
    (`patternProperties`, which lets other keys through) into `propertyNames`."""
    if isinstance(node, dict):
        node = {k: _tighten(v) for k, v in node.items() if k != "title"}
        if len(node.get("patternProperties", {})) == 1:
            (pattern, value), *_ = node.pop("patternProperties").items()
            node["propertyNames"] = {**node.get("propertyNames", {}), "pattern": pattern}
            node["additionalProperties"] = value
        return node
    if isinstance(node, list):
        return [_tighten(v) for v in node]
    return node


def values_schema() -> dict[str, Any]:
    """values.schema.json (draft 2020-12, as Helm 4 validates it)."""
    schema = _tighten(ChartValues.model_json_schema(by_alias=True, mode="validation"))
    props = schema["properties"]
    props["watchNamespaces"]["uniqueItems"] = True  # what ChartValues._unique checks
    # Helm's own key for values shared with subcharts; the chart has none but Helm allows it.
    props["global"] = {"type": "object", "description": "Helm's shared values (unused)."}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def defaults() -> dict[str, Any]:
    """The default values, keyed as in values.yaml."""
    return ChartValues().model_dump(mode="json", by_alias=True)
