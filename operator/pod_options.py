"""A role's own pod settings (`spec.trainer.pod`, `spec.rollout.pod`) added to a pod the
planner built: a pure function over plain data.

Only additions: the operator's volumes, mounts, variables, labels and hardening are kept
as built (the job file refuses anything that would collide with them, naming the field),
and capabilities are added back only from the allow-list of `config.pods`. Ray head and
worker pods are rollout pods: they get `spec.rollout.pod`, as they get `spec.rollout.env`.
"""

from __future__ import annotations

from typing import Any

from rlft.operator import names as N
from rlft.trainer.config import RLFineTune
from rlft.trainer.config.pods import PodCustomisation, PodVolume


def of_role(job: RLFineTune, role: str) -> PodCustomisation:
    """The settings of a role's pods: the trainer's, or the rollout's for rollout pods and
    the Ray heads and workers of multi-node rollout instances."""
    return job.spec.trainer.pod if role == N.ROLE_TRAINER else job.spec.rollout.pod


def _volume(volume: PodVolume) -> dict[str, Any]:
    # Every field is written out (readOnly: true included): the pod says what it gets.
    source = volume.model_dump(by_alias=True, exclude_none=True)
    return {"name": source.pop("name"), **source}


def customise(pod: dict[str, Any], options: PodCustomisation) -> dict[str, Any]:
    """`pod` (freshly built by the planner, changed in place) with the role's own settings
    added, and returned."""
    metadata, spec = pod["metadata"], pod["spec"]
    container = spec["containers"][0]
    # The operator's labels win; the job file refuses their keys anyway.
    metadata["labels"] = {**options.labels, **metadata["labels"]}
    if options.annotations:
        metadata["annotations"] = {**options.annotations, **metadata.get("annotations", {})}
    spec["volumes"] += [_volume(v) for v in options.volumes]
    container["volumeMounts"] += [
        {
            "name": m.name,
            "mountPath": m.mount_path,
            "readOnly": options.mount_read_only(m),
            **({"subPath": m.sub_path} if m.sub_path else {}),
        }
        for m in options.volume_mounts
    ]
    if options.env_from:
        container["envFrom"] = [
            e.model_dump(by_alias=True, exclude_none=True) for e in options.env_from
        ]
    if options.capabilities:
        # Still drop ALL first: the added ones are the only capabilities the container has.
        container["securityContext"]["capabilities"]["add"] = list(options.capabilities)
    if options.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s.name} for s in options.image_pull_secrets]
    if options.service_account_name:
        spec["serviceAccountName"] = options.service_account_name
    spec["automountServiceAccountToken"] = options.automount_service_account_token
    if options.runtime_class_name:
        spec["runtimeClassName"] = options.runtime_class_name
    return pod
