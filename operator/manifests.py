"""Builders of the Kubernetes objects of one job: pure functions from the job to manifests.

What runs where (docs/architecture.md, "Processes of one job"):

- a ConfigMap with the rendered job file, mounted read-only into every pod;
- for a job that samples, a Secret with its tokens (its rollout API's, given to its
  trainer, rollout and Ray head pods; its Ray clusters', given to its Ray pods), drawn
  when the Secret is created (`token_secret`);
- a NetworkPolicy that opens the job's unauthenticated ports to its own pods only
  (`network_policy`; Settings.network_policy);
- a headless Service for the trainer gang's rendezvous (pods get stable DNS names);
- `replicas.max` trainer pods running `torchrun --nnodes=min:max` with the elastic-restart
  environment docs/build.md asks for (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a short
  last_call_timeout);
- one pod per rollout instance, or, for an instance spanning several nodes, a Ray head
  (which also serves the rollout protocol) and Ray workers; a headless Service gives each
  instance the same DNS name either way.

Trainer pods get a startup and a liveness probe on the rank's progress, rollout pods a
startup and a readiness probe (`probes.py`). Every pod is hardened (non-root, read-only
root filesystem, no privilege escalation, all capabilities dropped, seccomp
RuntimeDefault) and owned by the RLFineTune. A role's own settings (`spec.<role>.pod`:
volumes, envFrom, service account, …) are added last, by `pod_options.customise`.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlft.operator import gang as G
from rlft.operator import names as N
from rlft.operator import pod_spec, probes
from rlft.operator.pod_spec import JOB_FILE, WORKSPACE, Settings
from rlft.trainer.addresses import ALL as ALL_ADDRESSES
from rlft.trainer.config import RLFineTune, dump_job


def weights_uri(job: RLFineTune) -> str | None:
    """Where trainer rank 0 publishes weights for the rollout pods: the job's own
    `rollout.weightsUri`, else a `weights/` prefix under the checkpoint location."""
    uri = job.spec.rollout.weights_uri or job.spec.checkpoint.uri
    if uri is None or job.spec.rollout.weights_uri:
        return uri
    return uri.rstrip("/") + "/weights"


def rendered(job: RLFineTune, s: Settings) -> RLFineTune:
    """The job as its pods read it: what only the operator knows filled in (the address
    and port of /status and /metrics it polls and scrapes, the weights location)."""
    spec = job.spec
    telemetry = spec.telemetry.model_copy(
        update={"enabled": True, "host": ALL_ADDRESSES, "port": s.status_port}
    )
    rollout = spec.rollout.model_copy(update={"weights_uri": weights_uri(job)})
    return job.model_copy(
        update={"spec": spec.model_copy(update={"telemetry": telemetry, "rollout": rollout})}
    )


def config_map(job: RLFineTune, body: dict[str, Any], s: Settings | None = None) -> dict[str, Any]:
    """The rendered job file (defaults and what the operator knows filled in). Holds no
    secret: credentials are referenced by Secret name only and reach the pods as
    secretKeyRef environment variables."""
    s = s or Settings()
    document = dump_job(rendered(job, s))
    document["metadata"] = {"name": job.metadata.name, "namespace": body["metadata"]["namespace"]}
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": pod_spec.object_metadata(body, N.config_map_name(job.metadata.name)),
        "data": {"job.yaml": text},
    }


TOKEN_ANNOTATION = "rlft.dev/tokens"


def token_secret(body: dict[str, Any]) -> dict[str, Any]:
    """The Secret of the job's tokens (its rollout API's; its Ray clusters'), without
    them: the operator draws them as it sends the create (`with_tokens`), so no builder,
    plan or log ever holds one. Sent before each round of pod creations: a Secret deleted
    by hand is made again, one that exists is kept (409), and the pods wait for it as for
    any Secret they reference."""
    meta = body["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": pod_spec.object_metadata(body, N.token_secret(meta["name"], meta["uid"]))
        | {"annotations": {TOKEN_ANNOTATION: "drawn by the operator when it creates this Secret"}},
        "type": "Opaque",
        "data": {},
    }


def with_tokens(secret: dict[str, Any], rollout: str, ray: str) -> dict[str, Any]:
    """The token Secret to send, holding the two tokens (base64, as the API stores them)."""
    tokens = {N.TOKEN_KEY: rollout, N.RAY_TOKEN_KEY: ray}
    return {**secret, "data": {k: base64.b64encode(v.encode()).decode() for k, v in tokens.items()}}


def network_policy(job: RLFineTune, body: dict[str, Any], s: Settings) -> dict[str, Any]:
    """Ingress to the job's pods: from each other, on any port (torchrun's rendezvous
    store, the collectives' and the weight broadcast's connections, Ray's ports: none of
    them authenticates its callers), and from anywhere only on the ports that are read
    or guarded: the trainers' /status and /metrics (the operator, Prometheus), the
    rollout protocol (its token; /metrics), /livez (the kubelet). Egress is left alone:
    the pods reach the object store and the Hugging Face Hub."""
    selector = {"matchLabels": {N.LABEL_JOB: job.metadata.name}}
    open_ports = sorted({s.status_port, s.rollout_port, s.liveness_port})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": pod_spec.object_metadata(
            body, N.network_policy(job.metadata.name, body["metadata"]["uid"])
        ),
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": selector}]},
                {"ports": [{"protocol": "TCP", "port": port} for port in open_ports]},
            ],
        },
    }


def _service(
    body: dict[str, Any], name: str, selector: dict[str, str], ports: list[tuple[str, int]]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pod_spec.object_metadata(body, name),
        "spec": {
            "clusterIP": "None",
            # Rendezvous and Ray need the DNS names before the pods are ready.
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}
                for port_name, port in ports
            ],
        },
    }


def trainer_service(job: RLFineTune, body: dict[str, Any], s: Settings) -> dict[str, Any]:
    name = job.metadata.name
    selector = {N.LABEL_JOB: name, N.LABEL_ROLE: N.ROLE_TRAINER}
    ports = [("rdzv", s.rdzv_port), ("status", s.status_port)]
    return _service(body, N.trainer_service(name), selector, ports)


def rollout_service(job: RLFineTune, body: dict[str, Any], s: Settings) -> dict[str, Any]:
    name = job.metadata.name
    selector = {N.LABEL_JOB: name, N.LABEL_SERVES: "rollout"}
    return _service(body, N.rollout_service(name), selector, [("http", s.rollout_port)])


SHUTDOWN_MARGIN_SECONDS = 15
"""Trainer pods' grace past the job's own: the agent exits after its workers."""


def trainer_grace_seconds(job: RLFineTune) -> int:
    """spec.checkpoint.gracePeriodSeconds: the trainer's time for its emergency checkpoint."""
    return math.ceil(job.spec.checkpoint.grace_period_seconds)


def torchrun_command(
    job: RLFineTune,
    body: dict[str, Any],
    s: Settings,
    resume: str,
    gang: int = 0,
    index: int = 0,
) -> list[str]:
    """Trainer pod `index`'s command: an elastic torchrun agent joining the rendezvous of
    the job's gang attempt `gang` (status.gangAttempt), hosted by trainer-0's agent."""
    spec = job.spec
    replicas = spec.trainer.replicas
    svc = N.trainer_service(job.metadata.name)
    host = f"trainer-0.{svc}.{pod_spec.namespace_of(body)}.svc"
    timeout = spec.scheduling.scheduling_timeout_seconds
    return [
        "torchrun",
        f"--nnodes={replicas.min}:{replicas.max}",
        f"--nproc-per-node={pod_spec.ranks_per_pod(job, N.ROLE_TRAINER)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={host}:{s.rdzv_port}",
        f"--rdzv-id={body['metadata']['uid']}-{gang}",
        # Who hosts the store, said rather than guessed: torch guesses it by resolving
        # the endpoint's DNS name to the pod itself, and a record not published yet (or
        # a cached NXDOMAIN) left trainer-0 a client of a store nobody hosted.
        f"--rdzv-conf=join_timeout={timeout},last_call_timeout={s.last_call_timeout},"
        f"is_host={'true' if index == 0 else 'false'}",
        # Every restart is the operator's: torchrun would restart a worker that exited 2
        # (a permanent error) and its restarts would escape the restart budget. Elastic
        # membership changes (a node back) still restart the workers in place.
        "--max-restarts=0",
        # SIGTERM reaches the workers through the agent, which SIGKILLs them after this
        # (30 s by default): the emergency checkpoint gets the job's whole grace. Not on
        # an elastic membership change: the agent stops its workers with its own 30 s.
        f"--shutdown-timeout={trainer_grace_seconds(job)}",
        "--no-python",
        "rlft",
        "train",
        JOB_FILE,
        "--out",
        f"{WORKSPACE}/run",
        f"--resume={resume}",
    ]


def trainer_pods(
    job: RLFineTune, body: dict[str, Any], s: Settings, resume: str, gang: int = 0
) -> dict[str, dict[str, Any]]:
    spec = job.spec
    resources = pod_spec.container_resources(spec.trainer.resources, spec.trainer.gpus_per_pod)
    pods = {}
    checked = probes.trainer_probes(job, s.liveness_port)
    probed = [("liveness", s.liveness_port)] if checked else []
    for i in range(spec.trainer.replicas.max):
        # Rank 0 serves /status and /metrics, and it runs on trainer-0: torchrun ranks
        # the gang's agents by host name, and no gang forms without trainer-0 (it hosts
        # the rendezvous). Declared on the others, the port made the jobs PodMonitor
        # scrape targets nothing listens on (always down: TargetDown alerts).
        served = [("status", s.status_port)] if i == 0 else []
        ports = [("rdzv", s.rdzv_port), *served, *probed]
        pod = pod_spec.job_pod(
            job,
            body,
            s,
            name=N.trainer_pod(job.metadata.name, i),
            role=N.ROLE_TRAINER,
            index=i,
            hostname=f"trainer-{i}",
            subdomain=N.trainer_service(job.metadata.name),
            image=spec.trainer.image,
            command=torchrun_command(job, body, s, resume, gang, i),
            ports=ports,
            resources=resources,
            grace_seconds=trainer_grace_seconds(job) + SHUTDOWN_MARGIN_SECONDS,
            attempt=gang,
        )
        container = pod["spec"]["containers"][0]
        # The elastic agent needs this, or restarted workers hang in gloo/NCCL (docs/build.md).
        container["env"].append({"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"})
        # Which gang attempt this is (the rendezvous id's suffix), for planted drills.
        container["env"].append({"name": "RLFT_GANG_ATTEMPT", "value": str(gang)})
        # Written into each checkpoint's manifest: which checkpoints are this job's own.
        container["env"].append({"name": "RLFT_JOB_UID", "value": body["metadata"]["uid"]})
        if checked:
            container["env"].append({"name": "RLFT_LIVENESS_PORT", "value": str(s.liveness_port)})
            container.update(checked)
        pods[pod["metadata"]["name"]] = pod
    return pods


def rollout_command(job: RLFineTune, s: Settings, instance: int, ray: bool) -> list[str]:
    rollout = job.spec.rollout
    command = [
        "rlft",
        "rollout",
        JOB_FILE,
        "--host",
        ALL_ADDRESSES,
        "--port",
        str(s.rollout_port),
        "--instance",
        str(instance),
        "--tensor-parallel",
        str(rollout.tensor_parallel),
        "--expert-parallel",
        str(rollout.expert_parallel),
    ]
    if ray:  # the head's own address: Ray binds its pod IP, not loopback
        address = f"$(RLFT_POD_IP):{s.ray_port}"
        command += ["--ray-address", address, "--nodes", str(rollout.nodes_per_instance)]
    return command


def rollout_pods(job: RLFineTune, body: dict[str, Any], s: Settings) -> dict[str, dict[str, Any]]:
    if not pod_spec.samples(job):
        return {}
    rollout = job.spec.rollout
    name = job.metadata.name
    svc = N.rollout_service(name)
    nodes = rollout.nodes_per_instance
    gpus_per_node = math.ceil(rollout.gpus_per_instance / nodes)
    resources = pod_spec.container_resources(rollout.resources, gpus_per_node)
    serves = {N.LABEL_SERVES: "rollout"}
    pods: dict[str, dict[str, Any]] = {}
    for k in range(rollout.instances):
        if nodes == 1:
            pod = pod_spec.job_pod(
                job,
                body,
                s,
                name=N.rollout_pod(name, k),
                role=N.ROLE_ROLLOUT,
                index=k,
                hostname=f"rollout-{k}",
                subdomain=svc,
                image=rollout.image,
                command=rollout_command(job, s, k, ray=False),
                ports=[("http", s.rollout_port)],
                resources=resources,
                extra_labels=serves,
            )
            pod["spec"]["containers"][0].update(probes.rollout_probes(job, s.rollout_port))
            pods[pod["metadata"]["name"]] = pod
            continue
        head_host = f"rollout-{k}.{svc}.{pod_spec.namespace_of(body)}.svc"
        serve = " ".join(rollout_command(job, s, k, ray=True))
        head = pod_spec.job_pod(
            job,
            body,
            s,
            name=N.ray_head_pod(name, k),
            role=N.ROLE_RAY_HEAD,
            index=k,
            hostname=f"rollout-{k}",
            subdomain=svc,
            image=rollout.image,
            command=[
                "sh",
                "-c",
                f"ray start --head --node-ip-address=$(RLFT_POD_IP) --port={s.ray_port} "
                f"--num-gpus={gpus_per_node} --dashboard-host=127.0.0.1 "
                f"--disable-usage-stats && exec {serve}",
            ],
            ports=[("http", s.rollout_port), ("ray", s.ray_port)],
            resources=resources,
            extra_labels=serves,
        )
        # The head serves the rollout protocol once its Ray cluster has formed.
        head["spec"]["containers"][0].update(probes.rollout_probes(job, s.rollout_port))
        pods[head["metadata"]["name"]] = head
        for j in range(1, nodes):
            worker = pod_spec.job_pod(
                job,
                body,
                s,
                name=N.ray_worker_pod(name, k, j),
                role=N.ROLE_RAY_WORKER,
                index=k,
                hostname=f"rollout-{k}-worker-{j}",
                subdomain=None,
                image=rollout.image,
                command=[
                    "ray",
                    "start",
                    f"--address={head_host}:{s.ray_port}",
                    "--node-ip-address=$(RLFT_POD_IP)",
                    f"--num-gpus={gpus_per_node}",
                    "--disable-usage-stats",
                    "--block",
                ],
                ports=[],
                resources=resources,
                extra_labels={"rlft.dev/node": str(j)},
            )
            pods[worker["metadata"]["name"]] = worker
    return pods


@dataclass(frozen=True)
class Desired:
    """Every child one job should have."""

    config_maps: dict[str, dict[str, Any]]
    services: dict[str, dict[str, Any]]
    pods: dict[str, dict[str, Any]]
    pod_groups: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The gang's PodGroup (spec.scheduling.gang volcano or coscheduling): created before
    the pods, which a gang scheduler places only with it."""
    guards: list[dict[str, Any]] = field(default_factory=list)
    """The job's token Secret (jobs that sample; without its tokens: `token_secret`) and
    its NetworkPolicy (Settings.network_policy). Neither is watched (the operator may
    create them, not read them): both are sent before each round of pod creations, and
    one that exists is kept (409)."""

    def all(self) -> list[dict[str, Any]]:
        return [
            *self.config_maps.values(),
            *self.services.values(),
            *self.guards,
            *self.pod_groups.values(),
            *self.pods.values(),
        ]


def desired(
    job: RLFineTune, body: dict[str, Any], s: Settings, resume: str, gang: int = 0
) -> Desired:
    """All children of a job; `resume` is the trainer's --resume argument for new pods,
    `gang` the trainer gang's attempt (its rendezvous id)."""
    cm = config_map(job, body, s)
    services = [trainer_service(job, body, s), rollout_service(job, body, s)]
    pods = {**trainer_pods(job, body, s, resume, gang), **rollout_pods(job, body, s)}
    guards = [token_secret(body)] if pod_spec.samples(job) else []
    if s.network_policy:
        guards.append(network_policy(job, body, s))
    return Desired(
        config_maps={cm["metadata"]["name"]: cm},
        services={svc["metadata"]["name"]: svc for svc in services},
        guards=guards,
        pods=pods,
        pod_groups=G.pod_groups(
            job, pods, pod_spec.object_metadata(body, G.group_name(job.metadata.name))
        ),
    )
