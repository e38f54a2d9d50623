"""What every pod of a job shares, whatever its role: metadata owned by the RLFineTune,
the operator's environment (credentials as secretKeyRefs only), resources, the job file
and scratch volumes, hardening, lost-node tolerations and the gang keys. manifests.py
builds each role's pods from `job_pod`."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from rlft.operator import gang as G
from rlft.operator import names as N
from rlft.operator import options, pod_options
from rlft.trainer.api_token import TOKEN_ENV as ROLLOUT_TOKEN_ENV
from rlft.trainer.config import RLFineTune
from rlft.trainer.config.algorithm import SOURCES
from rlft.trainer.config.model import vllm_cpu_head_problem
from rlft.trainer.config.pods import PodCustomisation
from rlft.trainer.secret_sources import SECRET_NAMES_ENV, SECRET_PATH_ENV

CONFIG_DIR = "/etc/rlft"
JOB_FILE = f"{CONFIG_DIR}/job.yaml"
WORKSPACE = "/workspace"
GPU_RESOURCE = "nvidia.com/gpu"
TERMINATION_LOG = "/dev/termination-log"
"""Where each container writes its verdict (the Kubernetes default path)."""
SCRUBBED = ["rlft", "scrubbed", "--"]
"""What every container's command runs under: its output, whatever process writes it,
reaches the pod's log without the secrets of its environment (trainer/cli/scrubbed.py)."""
# Keys read from spec.checkpoint.credentialsSecret (the usual S3 environment variables).
CREDENTIAL_KEYS = (
    ("AWS_ACCESS_KEY_ID", False),
    ("AWS_SECRET_ACCESS_KEY", False),
    ("AWS_SESSION_TOKEN", True),
    ("AWS_ENDPOINT_URL", True),
    ("AWS_REGION", True),
)


@dataclass(frozen=True)
class Settings:
    """Operator-wide knobs of the pods it builds (not part of a job's spec)."""

    status_port: int = options.TRAINER_STATUS_PORT
    """Port of the trainer's /metrics and /status (rank 0 serves /status)."""
    rdzv_port: int = options.RENDEZVOUS_PORT
    """Port of torchrun's c10d rendezvous store on trainer pod 0."""
    rollout_port: int = options.ROLLOUT_PORT
    """Port of the rollout protocol (POST /generate, POST /weights, GET /healthz)."""
    liveness_port: int = options.LIVENESS_PORT
    """Port of each trainer pod's liveness endpoint (local rank 0 serves GET /livez)."""
    ray_port: int = options.RAY_PORT
    """Port of a multi-node rollout instance's Ray head."""
    grace_seconds: int = options.GRACE_SECONDS
    """terminationGracePeriodSeconds of rollout pods (trainer pods: their job's own grace)."""
    last_call_timeout: int = 5
    """torchrun rendezvous: seconds to wait for more nodes once `min` have joined."""
    run_as_user: int = 1000
    """UID (and GID) the containers run as."""
    network_policy: bool = True
    """A NetworkPolicy per job (manifests.network_policy): the rendezvous store, the
    collectives' and Ray's ports open to the job's own pods only."""


def owner_reference(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {
        "apiVersion": job.get("apiVersion", "rlft.dev/v1alpha1"),
        "kind": job.get("kind", "RLFineTune"),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_metadata(
    body: dict[str, Any], name: str, role: str | None = None, index: int | None = None
) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": N.labels(meta["name"], role, index),
        "ownerReferences": [owner_reference(body)],
    }


def namespace_of(body: dict[str, Any]) -> str:
    return body["metadata"]["namespace"]


def samples(job: RLFineTune) -> bool:
    """Whether the job's algorithm trains on rollouts (DPO and SFT need no rollout pods)."""
    return SOURCES[job.spec.algorithm.name] == "rollouts"


def spec_problems(job: RLFineTune) -> list[str]:
    """What the job asks of pods that they could not do, though the spec is valid (the
    trainer finds these only after its warm start)."""
    rollout, init = job.spec.rollout, job.spec.model.init
    if not samples(job) or rollout.engine != "vllm" or rollout.gpus_per_instance or init is None:
        return []
    shape = {"hidden_size": init.hidden_size, "num_attention_heads": init.num_heads}
    problem = vllm_cpu_head_problem(shape)
    if problem is None:
        return []
    return [
        f"spec.rollout.engine: {problem}; rollout pods without "
        "spec.rollout.gpusPerInstance run it on the CPU"
    ]


def rollout_urls(job: RLFineTune, body: dict[str, Any], s: Settings) -> list[str]:
    """One stable URL per rollout instance (its DNS name under the rollout Service)."""
    if not samples(job):
        return []
    svc, ns = N.rollout_service(job.metadata.name), namespace_of(body)
    port = s.rollout_port
    return [f"http://rollout-{i}.{svc}.{ns}.svc:{port}" for i in range(job.spec.rollout.instances)]


NODE_LOST_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def node_lost_tolerations(scheduling: Any, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How long a pod waits for its node to report again (spec.scheduling.nodeLostSeconds)
    before the taint manager evicts it, unless the job's own tolerations say."""
    keys = {t.get("key") for t in own}
    return [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": scheduling.node_lost_seconds,
        }
        for key in NODE_LOST_TAINTS
        if key not in keys
    ]


def container_resources(spec_resources: Any, gpus: int) -> dict[str, Any]:
    # Extended resources (RDMA, EFA, …) cannot be overcommitted: request = limit.
    requests = {**spec_resources.requests, **spec_resources.extended}
    limits = {**spec_resources.limits, **spec_resources.extended}
    if gpus:
        requests[GPU_RESOURCE] = gpus
        limits[GPU_RESOURCE] = gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


TOKEN_ROLES = (N.ROLE_TRAINER, *N.API_SERVERS)
"""Pods given the rollout token: those that call the rollout API or serve it (a Ray
worker only lends its node to an instance)."""


def without_rollout_token(pod: dict[str, Any]) -> dict[str, Any]:
    """A copy of `pod` whose containers are not given the rollout token: a rollout pod
    made for trainers started by an operator from before tokens. Those send none, and a
    server given one would refuse them all (observe.PodView.rollout_token)."""
    out = copy.deepcopy(pod)
    for container in out["spec"]["containers"]:
        env = container.get("env") or []
        container["env"] = [e for e in env if e.get("name") != ROLLOUT_TOKEN_ENV]
    return out


def _token_ref(body: dict[str, Any], key: str) -> dict[str, Any]:
    name = N.token_secret(body["metadata"]["name"], body["metadata"]["uid"])
    return {"secretKeyRef": {"name": name, "key": key}}


def operator_env(
    job: RLFineTune, body: dict[str, Any], s: Settings, role: str
) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "RLFT_JOB_NAME", "value": job.metadata.name},
        {"name": "RLFT_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "RLFT_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # In /status: the poller drops another pod's document (an address reused).
        {"name": "RLFT_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "RLFT_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RLFT_STATUS_PORT", "value": str(s.status_port)},
        {"name": "RLFT_TERMINATION_LOG", "value": TERMINATION_LOG},
        {"name": "RLFT_ROLLOUT_URLS", "value": ",".join(rollout_urls(job, body, s))},
        {"name": "HOME", "value": f"{WORKSPACE}/home"},
        {"name": "HF_HOME", "value": f"{WORKSPACE}/hf"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if samples(job) and role in TOKEN_ROLES:
        env.append({"name": ROLLOUT_TOKEN_ENV, "valueFrom": _token_ref(body, N.TOKEN_KEY)})
    if role in N.RAY_ROLES:
        # Ray's token authentication (Ray 2.52 and later), with the job's Ray token:
        # without it any pod that reaches the head can run code in the cluster (its jobs
        # API and GCS take whoever connects).
        env.append({"name": "RAY_AUTH_MODE", "value": "token"})
        env.append({"name": "RAY_AUTH_TOKEN", "valueFrom": _token_ref(body, N.RAY_TOKEN_KEY)})
    secret = job.spec.checkpoint.credentials_secret
    if secret:
        for key, optional in CREDENTIAL_KEYS:
            ref: dict[str, Any] = {"name": secret, "key": key}
            if optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def job_env(job: RLFineTune, role: str) -> list[dict[str, Any]]:
    """The job's own variables for the role (spec.trainer.env or spec.rollout.env, the
    latter for Ray head and worker pods too), after the operator's."""
    env = job.spec.trainer.env if role == N.ROLE_TRAINER else job.spec.rollout.env
    own = [e.model_dump(by_alias=True, exclude_none=True) for e in env]
    # Their values from Secrets, and the files of the Secrets the role mounts, are kept
    # out of the pod's log and error texts (secret_sources.py).
    hidden = [e["name"] for e in own if "secretKeyRef" in (e.get("valueFrom") or {})]
    if hidden:
        own.append({"name": SECRET_NAMES_ENV, "value": ",".join(hidden)})
    if mounts := secret_mounts(pod_options.of_role(job, role)):
        own.append({"name": SECRET_PATH_ENV, "value": json.dumps(mounts)})
    return own


def secret_mounts(options: PodCustomisation) -> list[str]:
    """Where the role's containers mount its Secret volumes."""
    secrets = {v.name for v in options.volumes if v.secret is not None}
    return [m.mount_path for m in options.volume_mounts if m.name in secrets]


def thread_env(
    resources: dict[str, Any], own: list[dict[str, Any]], processes: int = 1
) -> list[dict[str, Any]]:
    """`own` (the job's variables) after OMP_NUM_THREADS from the container's CPUs, its
    limit or else its request, shared by its `processes` (a trainer pod's ranks: torchrun
    keeps a value it finds, so each rank took the whole pod's), rounded down (at least
    1): torch otherwise starts a thread per core of the node however few the pod may use,
    and the pods of a job sharing a node fight for them. A job that sets the variable
    itself keeps its value."""
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu")
    if cpu is None or any(e["name"] == "OMP_NUM_THREADS" for e in own):
        return own
    threads = max(1, math.floor(G.quantity(cpu) / max(1, processes)))
    return [{"name": "OMP_NUM_THREADS", "value": str(threads)}, *own]


def ranks_per_pod(job: RLFineTune, role: str) -> int:
    """Training processes a pod of the role runs (torchrun's --nproc-per-node)."""
    return max(1, job.spec.trainer.gpus_per_pod) if role == N.ROLE_TRAINER else 1


def pod_volumes(job: RLFineTune) -> list[dict[str, Any]]:
    return [
        {"name": "job", "configMap": {"name": N.config_map_name(job.metadata.name)}},
        {"name": "workspace", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
    ]


MOUNTS = [
    {"name": "job", "mountPath": CONFIG_DIR, "readOnly": True},
    {"name": "workspace", "mountPath": WORKSPACE},
    {"name": "tmp", "mountPath": "/tmp"},
    {"name": "dshm", "mountPath": "/dev/shm"},
]


def container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def job_pod(
    job: RLFineTune,
    body: dict[str, Any],
    s: Settings,
    *,
    name: str,
    role: str,
    index: int,
    hostname: str,
    subdomain: str | None,
    image: str,
    command: list[str],
    ports: list[tuple[str, int]],
    resources: dict[str, Any],
    extra_labels: dict[str, str] | None = None,
    grace_seconds: int | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    scheduling = job.spec.scheduling
    metadata = object_metadata(body, name, role, index)
    metadata["labels"].update(extra_labels or {})
    container: dict[str, Any] = {
        "name": "main",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": [*SCRUBBED, *command],
        "env": operator_env(job, body, s, role)
        + thread_env(resources, job_env(job, role), ranks_per_pod(job, role)),
        "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
        "volumeMounts": [dict(m) for m in MOUNTS],
        "securityContext": container_security(),
        # The process's verdict (trainer/termination.py) is the termination message; when
        # it wrote none (killed), the end of the log is, so the failure policy can tell a
        # rendezvous or NCCL timeout from other errors. Neither is copied into the status.
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if resources:
        container["resources"] = resources
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator restarts, so it can count and back off
        "hostname": hostname,
        "terminationGracePeriodSeconds": grace_seconds or s.grace_seconds,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The pod's sandbox is PID 1 then, not the command: the kernel gives a PID 1 no
        # SIGTERM it has no handler for, and torchrun (before its rendezvous ends) and
        # `ray start` have none, so a deleted pod would hold its name (and GPUs) for its
        # whole grace period. The sandbox also reaps the orphans torch and Ray leave.
        "shareProcessNamespace": True,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": s.run_as_user,
            "runAsGroup": s.run_as_user,
            "fsGroup": s.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": pod_volumes(job),
    }
    if subdomain:
        spec["subdomain"] = subdomain
    if scheduling.node_selector:
        spec["nodeSelector"] = dict(scheduling.node_selector)
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in scheduling.tolerations]
    spec["tolerations"] = tolerations + node_lost_tolerations(scheduling, tolerations)
    if scheduling.affinity:
        spec["affinity"] = scheduling.affinity
    if scheduling.priority_class_name:
        spec["priorityClassName"] = scheduling.priority_class_name
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
    pod = pod_options.customise(pod, pod_options.of_role(job, role))
    return G.apply(pod, job, role, attempt)  # the gang kind's keys (operator/gang.py)
