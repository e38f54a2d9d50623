"""A role's own pod settings (`spec.trainer.pod`, `spec.rollout.pod`, `resources.extended`)
in the pods the planner builds: each field reaches the pods of its role (Ray heads and
workers are rollout pods), the operator's own volumes, variables, labels and hardening
stay as they were, and the result is a valid Kubernetes object."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from jobs import job_doc, parsed
from pod_jobs import EXTENDED, ROLLOUT_POD, TRAINER_POD, every_pod_setting

from rlft.operator import manifests as M
from rlft.operator import names as N
from rlft.operator import pod_spec
from rlft.trainer.config.pods import (
    OPERATOR_LABELS,
    OPERATOR_PATHS,
    OPERATOR_PREFIX,
    OPERATOR_VOLUMES,
)
from rlft.trainer.secret_sources import SECRET_PATH_ENV

SETTINGS = M.Settings()
OWN = {N.ROLE_TRAINER: TRAINER_POD}  # every other role is a rollout pod
HARDENED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _pods(doc: dict[str, Any]) -> list[dict[str, Any]]:
    job, body = parsed(doc)
    return list(M.desired(job, body, SETTINGS, "auto").pods.values())


def _role(pod: dict[str, Any]) -> str:
    return pod["metadata"]["labels"][N.LABEL_ROLE]


def _plain() -> dict[str, dict[str, Any]]:
    """The same job's pods without any pod setting, by name."""
    doc = every_pod_setting()
    for role in ("trainer", "rollout"):
        doc["spec"][role].pop("pod")
        doc["spec"][role]["resources"].pop("extended")
    return {p["metadata"]["name"]: p for p in _pods(doc)}


def test_every_role_is_planned():
    roles = sorted({_role(p) for p in _pods(every_pod_setting())})
    assert roles == sorted([N.ROLE_TRAINER, N.ROLE_RAY_HEAD, N.ROLE_RAY_WORKER])
    single = {_role(p) for p in _pods(every_pod_setting(multi_node=False))}
    assert single == {N.ROLE_TRAINER, N.ROLE_ROLLOUT}


@pytest.mark.parametrize("multi_node", [True, False], ids=["ray", "single-node"])
def test_each_role_gets_its_own_volumes_and_mounts_after_the_operators(multi_node):
    plain = _plain() if multi_node else None
    for pod in _pods(every_pod_setting(multi_node=multi_node)):
        own = OWN.get(_role(pod), ROLLOUT_POD)
        spec, (main,) = pod["spec"], pod["spec"]["containers"]
        operator_volumes = spec["volumes"][: len(OPERATOR_VOLUMES)]
        assert {v["name"] for v in operator_volumes} == OPERATOR_VOLUMES
        if plain is not None:  # the operator's part is exactly what it builds without them
            before = plain[pod["metadata"]["name"]]["spec"]
            assert operator_volumes == before["volumes"]
            assert main["volumeMounts"][:4] == before["containers"][0]["volumeMounts"]
        added_volumes = spec["volumes"][len(OPERATOR_VOLUMES) :]
        assert [v["name"] for v in added_volumes] == [v["name"] for v in own["volumes"]]
        added = main["volumeMounts"][4:]
        assert [(m["name"], m["mountPath"]) for m in added] == [
            (m["name"], m["mountPath"]) for m in own["volumeMounts"]
        ]
        assert all(isinstance(m["readOnly"], bool) for m in added)  # always written out


def test_volumes_are_written_as_kubernetes_volumes_with_read_only_claims():
    (trainer,) = [p for p in _pods(every_pod_setting()) if _role(p) == N.ROLE_TRAINER]
    volumes = {v["name"]: v for v in trainer["spec"]["volumes"]}
    assert volumes["model"] == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "qwen3-weights", "readOnly": True},
    }
    assert volumes["cache"]["persistentVolumeClaim"] == {
        "claimName": "rlft-cache",
        "readOnly": False,
    }
    assert volumes["staging"] == {"name": "staging", "emptyDir": {"sizeLimit": "200Gi"}}
    assert volumes["ramdisk"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["prompts"] == {"name": "prompts", "configMap": {"name": "prompt-templates"}}
    assert volumes["hf-token"] == {"name": "hf-token", "secret": {"secretName": "hf-token"}}
    mounts = {m["mountPath"]: m for m in trainer["spec"]["containers"][0]["volumeMounts"]}
    # Unset readOnly: read-only, except an emptyDir and a claim that is not read-only.
    read_only = {path: m["readOnly"] for path, m in mounts.items() if "readOnly" in m}
    assert read_only == {
        "/etc/rlft": True,  # the operator's
        "/models": True,
        "/data": True,
        "/cache": False,
        "/staging": False,
        "/ramdisk": False,
        "/etc/prompts": True,
        "/var/run/hf": True,
    }
    assert mounts["/data"]["subPath"] == "datasets/math"
    assert all("subPath" not in m for path, m in mounts.items() if path != "/data")


def test_env_from_pull_secrets_account_runtime_class_labels_and_annotations():
    plain = _plain()
    for pod in _pods(every_pod_setting()):
        own = OWN.get(_role(pod), ROLLOUT_POD)
        spec, (main,) = pod["spec"], pod["spec"]["containers"]
        expected = copy.deepcopy(own["envFrom"])
        for entry in expected:  # written out in full, as Kubernetes reads it
            for ref in ("configMapRef", "secretRef"):
                if ref in entry:
                    entry[ref].setdefault("optional", False)
        assert main["envFrom"] == expected
        # The operator's variables are unchanged (explicit env wins over envFrom), but
        # for where the role's Secret volumes are mounted (their files are scrubbed).
        env = [e for e in main["env"] if e["name"] != SECRET_PATH_ENV]
        assert env == plain[pod["metadata"]["name"]]["spec"]["containers"][0]["env"]
        assert spec["imagePullSecrets"] == own["imagePullSecrets"]
        assert spec["serviceAccountName"] == own["serviceAccountName"]
        assert spec["automountServiceAccountToken"] is own.get(
            "automountServiceAccountToken", False
        )
        assert spec["runtimeClassName"] == "nvidia"
        labels = pod["metadata"]["labels"]
        assert own["labels"].items() <= labels.items()
        operator_labels = plain[pod["metadata"]["name"]]["metadata"]["labels"]
        assert operator_labels.items() <= labels.items()  # every selector still matches
        assert pod["metadata"]["annotations"] == own["annotations"]


def test_pods_say_where_their_secret_volumes_are_mounted_and_nothing_else():
    """`rlft scrubbed` and `rlft`'s own streams hide what the files there hold."""
    for pod in _pods(every_pod_setting()):
        (main,) = pod["spec"]["containers"]
        said = [json.loads(e["value"]) for e in main["env"] if e["name"] == SECRET_PATH_ENV]
        # The trainer's hf-token Secret, not its claims, emptyDirs or ConfigMap.
        assert said == ([["/var/run/hf"]] if _role(pod) == N.ROLE_TRAINER else []), said
    doc = every_pod_setting(multi_node=False)
    mounts = doc["spec"]["trainer"]["pod"]["volumeMounts"]
    mounts.append({"name": "hf-token", "mountPath": "/etc/hf token:x", "subPath": "token"})
    doc["spec"]["rollout"]["pod"]["volumes"].append({"name": "s3", "secret": {"secretName": "s3"}})
    doc["spec"]["rollout"]["pod"]["volumeMounts"].append({"name": "s3", "mountPath": "/s3"})
    for pod in _pods(doc):
        (main,) = pod["spec"]["containers"]
        (value,) = [e["value"] for e in main["env"] if e["name"] == SECRET_PATH_ENV]
        trainer = ["/var/run/hf", "/etc/hf token:x"]  # any character but `/` in a path
        assert json.loads(value) == (trainer if _role(pod) == N.ROLE_TRAINER else ["/s3"])


def test_extended_resources_are_requested_and_limited_beside_gpus_and_cpu():
    for pod in _pods(every_pod_setting()):
        resources = pod["spec"]["containers"][0]["resources"]
        for kind in ("requests", "limits"):
            assert EXTENDED.items() <= resources[kind].items(), (pod["metadata"]["name"], kind)
            assert resources[kind]["nvidia.com/gpu"] == 2
        if _role(pod) == N.ROLE_TRAINER:
            assert resources["requests"]["cpu"] == "8" and "cpu" not in resources["limits"]


def test_hardening_stays_and_only_the_listed_capability_is_added():
    for pod in _pods(every_pod_setting()):
        spec, (main,) = pod["spec"], pod["spec"]["containers"]
        security = copy.deepcopy(main["securityContext"])
        added = security["capabilities"].pop("add", [])
        assert security == HARDENED  # ALL still dropped, nothing else relaxed
        assert added == OWN.get(_role(pod), ROLLOUT_POD).get("capabilities", [])
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["enableServiceLinks"] is False and spec["restartPolicy"] == "Never"


def test_without_pod_settings_nothing_is_added():
    for pod in _pods(job_doc()):
        spec, (main,) = pod["spec"], pod["spec"]["containers"]
        assert {"imagePullSecrets", "serviceAccountName", "runtimeClassName"}.isdisjoint(spec)
        assert spec["automountServiceAccountToken"] is False
        assert "envFrom" not in main and "annotations" not in pod["metadata"]
        assert main["securityContext"] == HARDENED
        assert {v["name"] for v in spec["volumes"]} == OPERATOR_VOLUMES


def test_what_the_job_file_reserves_is_what_the_operator_builds():
    """The names and paths `config.pods` refuses are exactly the operator's own: its
    volumes, the paths it mounts them at (and the termination log), its label keys."""
    for pod in _pods(job_doc()):
        spec, (main,) = pod["spec"], pod["spec"]["containers"]
        assert {v["name"] for v in spec["volumes"]} == OPERATOR_VOLUMES
        paths = {m["mountPath"] for m in main["volumeMounts"]} | {main["terminationMessagePath"]}
        assert paths == set(OPERATOR_PATHS)
        for key in pod["metadata"]["labels"]:
            assert key in OPERATOR_LABELS or key.startswith(OPERATOR_PREFIX), key
    assert pod_spec.CONFIG_DIR in OPERATOR_PATHS and pod_spec.WORKSPACE in OPERATOR_PATHS


def test_every_pod_passes_kubernetes_validate_strict(tmp_path: Path):
    documents = []
    for name, multi_node in (("ray", True), ("single", False)):
        job, body = parsed(every_pod_setting(name=name, multi_node=multi_node))
        documents += M.desired(job, body, SETTINGS, "auto").all()
    path = tmp_path / "pods.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    tool = str(Path(sys.executable).parent / "kubernetes-validate")
    result = subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(documents)
