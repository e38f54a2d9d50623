"""Names and labels of everything the operator creates for a job.

Every child has a deterministic name derived from the job and its slot (role, index). That
is what makes reconciling idempotent: a pod that already exists is never created twice, a
second create of the same name is refused by the API server (409), and two operators
cannot race each other into duplicates.
"""

from __future__ import annotations

import hashlib

MAX_LABEL = 63  # DNS-1123 label: Service names and pod hostnames

LABEL_JOB = "rlft.dev/job"
LABEL_ROLE = "rlft.dev/role"
LABEL_INDEX = "rlft.dev/index"
LABEL_SERVES = "rlft.dev/serves"
MANAGED_BY = "rlft-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"

ROLE_TRAINER = "trainer"
ROLE_ROLLOUT = "rollout"
ROLE_RAY_HEAD = "ray-head"
ROLE_RAY_WORKER = "ray-worker"
ROLES = (ROLE_TRAINER, ROLE_ROLLOUT, ROLE_RAY_HEAD, ROLE_RAY_WORKER)
RAY_ROLES = (ROLE_RAY_HEAD, ROLE_RAY_WORKER)
"""The pods of a Ray cluster: a multi-node rollout instance."""
API_SERVERS = (ROLE_ROLLOUT, ROLE_RAY_HEAD)
"""Roles that serve the rollout API (a multi-node instance serves it from its Ray head)."""


def child_name(job: str, suffix: str, limit: int = MAX_LABEL) -> str:
    """`{job}-{suffix}`, shortened with a stable hash when longer than `limit`, and starting
    with a letter (Service names must)."""
    name = f"{job}-{suffix}"
    if len(name) > limit:
        digest = hashlib.sha256(job.encode()).hexdigest()[:6]
        keep = limit - len(suffix) - len(digest) - 2
        name = f"{job[:keep].rstrip('-')}-{digest}-{suffix}"
    if not name[0].isalpha():
        name = ("r" + name)[:limit] if len(name) >= limit else "r" + name
    return name


def config_map_name(job: str) -> str:
    return child_name(job, "config", limit=253)


def token_secret(job: str, uid: str) -> str:
    """Named after the job's uid too: a job deleted and applied again under its name must
    not inherit the old one's Secret, which the garbage collector is about to remove."""
    return child_name(job, f"tokens-{uid[:8]}", limit=253)


def network_policy(job: str, uid: str) -> str:
    return child_name(job, f"ingress-{uid[:8]}", limit=253)


TOKEN_KEY = "token"
"""The key of the rollout API's token in the job's token Secret."""
RAY_TOKEN_KEY = "ray"
"""The key of the token of the job's Ray clusters (multi-node rollout instances)."""


def trainer_service(job: str) -> str:
    return child_name(job, "trainer")


def rollout_service(job: str) -> str:
    return child_name(job, "rollout")


def trainer_pod(job: str, index: int) -> str:
    return child_name(job, f"trainer-{index}", limit=253)


def rollout_pod(job: str, instance: int) -> str:
    return child_name(job, f"rollout-{instance}", limit=253)


def ray_head_pod(job: str, instance: int) -> str:
    return child_name(job, f"rollout-{instance}-head", limit=253)


def ray_worker_pod(job: str, instance: int, node: int) -> str:
    return child_name(job, f"rollout-{instance}-worker-{node}", limit=253)


def children_selector(job: str) -> str:
    """The label selector of a job's children: its name and the operator's mark, so a
    user's object that only carries `rlft.dev/job` is never taken (nor deleted) for one."""
    return f"{LABEL_JOB}={job},{LABEL_MANAGED_BY}={MANAGED_BY}"


def labels(job: str, role: str | None = None, index: int | None = None) -> dict[str, str]:
    """Labels of a child: selectable by job, and by role and slot for pods."""
    out = {
        "app.kubernetes.io/name": "rlft",
        "app.kubernetes.io/instance": job,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_JOB: job,
    }
    if role is not None:
        out["app.kubernetes.io/component"] = role
        out[LABEL_ROLE] = role
    if index is not None:
        out[LABEL_INDEX] = str(index)
    return out
