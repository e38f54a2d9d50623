"""A role's own pod settings in the job file (`spec.<role>.pod`, `resources.extended`):
what is accepted round-trips, and every refused value gives one line naming its field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rlft.trainer.config import JobFileError, dump_job, parse_job
from rlft.trainer.config.pods import ANNOTATIONS_BYTES, CAPABILITIES, PodCustomisation

MINIMAL: dict[str, Any] = {
    "apiVersion": "rlft.dev/v1alpha1",
    "kind": "RLFineTune",
    "metadata": {"name": "pods"},
    "spec": {"model": {"init": {}}},
}
MODEL = {"name": "model", "persistentVolumeClaim": {"claimName": "weights"}}
EVERYTHING: dict[str, Any] = {
    "volumes": [
        MODEL,
        {"name": "cache", "persistentVolumeClaim": {"claimName": "cache", "readOnly": False}},
        {"name": "scratch", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "templates", "configMap": {"name": "templates"}},
        {"name": "token", "secret": {"secretName": "hf-token"}},
    ],
    "volumeMounts": [
        {"name": "model", "mountPath": "/models"},
        {"name": "model", "mountPath": "/data", "subPath": "datasets/v1", "readOnly": True},
        {"name": "cache", "mountPath": "/cache", "readOnly": False},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "templates", "mountPath": "/etc/templates"},
        {"name": "token", "mountPath": "/var/run/hf"},
    ],
    "envFrom": [
        {"configMapRef": {"name": "nccl"}},
        {"secretRef": {"name": "wandb", "optional": True}, "prefix": "WANDB_"},
    ],
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccountName": "rlft-s3",
    "automountServiceAccountToken": True,
    "runtimeClassName": "nvidia",
    "labels": {"team": "rl", "example.com/cost-center": "42", "empty": ""},
    "annotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "capabilities": ["IPC_LOCK"],
}


def manifest(role: str = "trainer", resources: dict[str, Any] | None = None, **pod: Any):
    document = copy.deepcopy(MINIMAL)
    document["spec"][role] = {"pod": copy.deepcopy(pod)}
    if resources is not None:
        document["spec"][role]["resources"] = copy.deepcopy(resources)
    return document


def problems(document: dict[str, Any]) -> list[str]:
    with pytest.raises(JobFileError) as caught:
        parse_job(document, "job.yaml")
    return caught.value.problems


@pytest.mark.parametrize("role", ["trainer", "rollout"])
def test_every_pod_setting_round_trips(role):
    document = manifest(role, resources={"extended": {"rdma/hca": 1}}, **EVERYTHING)
    job = parse_job(document)
    dumped = dump_job(job)
    assert parse_job(dumped) == job
    written, kept = document["spec"][role], dumped["spec"][role]
    assert kept["resources"]["extended"] == {"rdma/hca": 1}
    _within(written["pod"], kept["pod"], "pod")  # every value as written, defaults added


def _within(given: Any, got: Any, where: str) -> None:
    if isinstance(given, dict):
        for key, value in given.items():
            assert key in got, f"{where}.{key} was dropped"
            _within(value, got[key], f"{where}.{key}")
    elif isinstance(given, list):
        assert len(given) == len(got), where
        for i, (a, b) in enumerate(zip(given, got, strict=True)):
            _within(a, b, f"{where}[{i}]")
    else:
        assert given == got, where


def test_defaults_add_nothing_and_keep_hardening():
    pod = parse_job(copy.deepcopy(MINIMAL)).spec.trainer.pod
    assert pod == PodCustomisation()
    assert pod.automount_service_account_token is False and pod.capabilities == []
    assert CAPABILITIES == ("IPC_LOCK",)


def test_a_mount_is_read_only_unless_its_volume_is_writable():
    job = parse_job(manifest(**EVERYTHING))
    pod = job.spec.trainer.pod
    read_only = {m.mount_path: pod.mount_read_only(m) for m in pod.volume_mounts}
    assert read_only == {
        "/models": True,
        "/data": True,
        "/cache": False,
        "/scratch": False,
        "/etc/templates": True,
        "/var/run/hf": True,
    }
    cache = copy.deepcopy(EVERYTHING)
    cache["volumeMounts"][2] = {"name": "cache", "mountPath": "/cache"}  # unset: writable
    pod = parse_job(manifest(**cache)).spec.trainer.pod
    assert pod.mount_read_only(pod.volume_mounts[2]) is False


def _mount(path: str, **more: Any) -> dict[str, Any]:
    return {"volumes": [MODEL], "volumeMounts": [{"name": "model", "mountPath": path, **more}]}


P = "spec.trainer.pod"
REFUSED = [
    # volumes
    (
        {"volumes": [{"name": "x", "emptyDir": {}, "configMap": {"name": "c"}}]},
        f"{P}.volumes[0]: volume x: set exactly one source",
    ),
    ({"volumes": [{"name": "x"}]}, f"{P}.volumes[0]: volume x: set exactly one source"),
    (
        {"volumes": [{"name": "workspace", "emptyDir": {}}]},
        f"{P}.volumes[0]: volume workspace: the operator's own volumes",
    ),
    ({"volumes": [{"name": "Model", "emptyDir": {}}]}, f"{P}.volumes[0].name: 'Model' is not"),
    (
        {"volumes": [{"name": "x", "persistentVolumeClaim": {"claimName": "A_B"}}]},
        f"{P}.volumes[0].persistentVolumeClaim.claimName: 'A_B' is not a DNS-1123 subdomain",
    ),
    (
        {"volumes": [{"name": "x", "hostPath": {"path": "/"}}]},
        f"{P}.volumes[0].hostPath: unknown field",
    ),
    (
        {"volumes": [{"name": "x", "emptyDir": {"sizeLimit": "lots"}}]},
        f"{P}.volumes[0].emptyDir.sizeLimit: 'lots' is not a Kubernetes quantity",
    ),
    (
        {"volumes": [{"name": "x", "emptyDir": {"medium": "HugePages"}}]},
        f"{P}.volumes[0].emptyDir.medium: must be one of 'Memory'",
    ),
    ({"volumes": [MODEL, MODEL]}, f"{P}: volumes: volume names must be unique; repeated: model"),
    # mounts
    (
        {"volumeMounts": [{"name": "model", "mountPath": "/models"}]},
        f"{P}: volumeMounts[0].name: no volume named model in volumes",
    ),
    *[
        (_mount(path), f"{P}: volumeMounts[0].mountPath: {path} {clash}")
        for path, clash in (
            ("/workspace", "is the operator's own /workspace"),
            ("/workspace/hf", "is inside the operator's /workspace"),
            ("/tmp", "is the operator's own /tmp"),
            ("/tmp/cache", "is inside the operator's /tmp"),
            ("/etc/rlft", "is the operator's own /etc/rlft"),
            ("/etc/rlft/extra", "is inside the operator's /etc/rlft"),
            ("/etc", "would hide the operator's /etc/rlft"),
            ("/dev", "would hide the operator's /dev/shm"),
            ("/dev/shm", "is the operator's own /dev/shm"),
            ("/dev/termination-log", "is the operator's own /dev/termination-log"),
        )
    ],
    *[
        (_mount(path), f"{P}.volumeMounts[0].mountPath: '{path}' is not an absolute path")
        for path in ("models", "/models/", "/models//x", "/models/../etc", "/./models", "/")
    ],
    *[
        (_mount("/m", subPath=sub), f"{P}.volumeMounts[0].subPath: '{sub}' is not a relative")
        for sub in ("/abs", "../up", "a/../../b", "a/")
    ],
    (
        {
            "volumes": [MODEL],
            "volumeMounts": [
                {"name": "model", "mountPath": "/m"},
                {"name": "model", "mountPath": "/m"},
            ],
        },
        f"{P}: volumeMounts: mount paths must be unique; repeated: /m",
    ),
    (
        _mount("/models", readOnly=False),
        f"{P}: volumeMounts[0].readOnly: volume model is read-only; set its "
        "persistentVolumeClaim.readOnly: false",
    ),
    (
        {
            "volumes": [{"name": "c", "configMap": {"name": "c"}}],
            "volumeMounts": [{"name": "c", "mountPath": "/c", "readOnly": False}],
        },
        f"{P}: volumeMounts[0].readOnly: volume c is read-only; configMap and secret",
    ),
    # envFrom, pull secrets, names
    (
        {"envFrom": [{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}]},
        f"{P}.envFrom[0]: give exactly one of configMapRef and secretRef",
    ),
    ({"envFrom": [{"prefix": "X_"}]}, f"{P}.envFrom[0]: give exactly one of"),
    (
        {"envFrom": [{"secretRef": {"name": "s"}, "prefix": "1X"}]},
        f"{P}.envFrom[0].prefix: '1X' is not a variable-name prefix",
    ),
    ({"imagePullSecrets": ["registry"]}, f"{P}.imagePullSecrets[0]: input should be"),
    ({"serviceAccountName": "S3 Reader"}, f"{P}.serviceAccountName: 'S3 Reader' is not"),
    ({"runtimeClassName": "Nvidia"}, f"{P}.runtimeClassName: 'Nvidia' is not"),
    # labels and annotations
    *[
        ({"labels": {key: "x"}}, f"{P}.labels: label key '{key}' is the operator's")
        for key in ("rlft.dev/job", "rlft.dev/anything", "app.kubernetes.io/managed-by")
    ],
    ({"labels": {"bad key": "x"}}, f"{P}.labels: label key 'bad key' is not a qualified name"),
    ({"labels": {"Example.com/x": "1"}}, f"{P}.labels: label key 'Example.com/x' is not"),
    ({"labels": {"team": "a" * 64}}, f"{P}.labels: label team: value"),
    ({"labels": {"team": "-rl"}}, f"{P}.labels: label team: value '-rl' is not a label value"),
    (
        {"annotations": {"rlft.dev/note": "x"}},
        f"{P}.annotations: annotation key 'rlft.dev/note' is the operator's",
    ),
    (
        {"annotations": {f"k{i}": "x" * 65536 for i in range(5)}},
        f"{P}.annotations: annotations hold",
    ),
    # capabilities
    ({"capabilities": ["SYS_ADMIN"]}, f"{P}.capabilities[0]: must be one of 'IPC_LOCK'"),
    ({"capabilities": ["IPC_LOCK", "IPC_LOCK"]}, f"{P}.capabilities: list should have at most"),
    ({"privileged": True}, f"{P}.privileged: unknown field"),
]


@pytest.mark.parametrize(("pod", "expected"), REFUSED, ids=lambda v: str(v)[:60])
def test_refused_pod_settings_name_the_field(pod, expected):
    lines = problems(manifest(**pod))
    assert len(lines) == 1, lines
    assert lines[0].startswith(expected), lines


def test_the_rollout_section_is_named_too():
    (line,) = problems(manifest("rollout", **_mount("/tmp")))
    assert line.startswith("spec.rollout.pod: volumeMounts[0].mountPath: /tmp is the operator's")


R = "spec.trainer.resources"


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ({"extended": {"cpu": 1}}, f"{R}: extended: 'cpu' is not an extended resource"),
        ({"extended": {"hugepages-2Mi": 1}}, f"{R}: extended: 'hugepages-2Mi' is not"),
        ({"extended": {"kubernetes.io/x": 1}}, f"{R}: extended: 'kubernetes.io/x' is not"),
        ({"extended": {"node.k8s.io/x": 1}}, f"{R}: extended: 'node.k8s.io/x' is not"),
        ({"extended": {"nvidia.com/gpu": 1}}, f"{R}: extended: nvidia.com/gpu comes from"),
        (
            {"extended": {"rdma/hca": 1}, "limits": {"rdma/hca": 2}},
            f"{R}: extended: rdma/hca is also in limits; give it once",
        ),
        ({"extended": {"rdma/hca": 0}}, f"{R}.extended.rdma/hca: must be ≥ 1"),
        ({"extended": {"rdma/hca": "1"}}, f"{R}.extended.rdma/hca: input should be"),
    ],
)
def test_refused_extended_resources_name_the_field(resources, expected):
    (line,) = problems(manifest(resources=resources))
    assert line.startswith(expected), line


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        # Used to pass validation and the CRD, then fail the operator's pod rendering.
        ({"requests": {"cpu": "8 cores"}}, f"{R}.requests.cpu: '8 cores' is not a Kubernetes"),
        ({"limits": {"memory": "64GB"}}, f"{R}.limits.memory: '64GB' is not a Kubernetes"),
        ({"requests": {"cpu": -1}}, f"{R}.requests.cpu: -1 is negative"),
        (
            {"requests": {"memory": "80Gi"}, "limits": {"memory": "64Gi"}},
            f"{R}: requests.memory (80Gi) is above limits.memory (64Gi); Kubernetes refuses",
        ),
    ],
)
def test_refused_requests_and_limits_name_the_field(resources, expected):
    lines = problems(manifest(resources=resources))
    assert lines and all(line.startswith(expected) for line in lines), lines


def test_requests_and_limits_accept_kubernetes_quantities():
    given = {"cpu": "500m", "memory": "1.5Gi", "ephemeral-storage": "1e9", "pods": 0}
    limits = {"cpu": 1, "memory": "2G", "ephemeral-storage": "2E"}
    job = parse_job(manifest(resources={"requests": given, "limits": limits}))
    assert job.spec.trainer.resources.requests == given


def test_extended_resources_accept_what_device_plugins_advertise():
    for name in ("rdma/hca_shared_devices_a", "vpc.amazonaws.com/efa", "nvidia.com/mig-1g.10gb"):
        job = parse_job(manifest(resources={"extended": {name: 4}}))
        assert job.spec.trainer.resources.extended == {name: 4}


def test_annotations_at_the_size_limit_are_accepted():
    value = "x" * (ANNOTATIONS_BYTES - 1)
    assert parse_job(manifest(annotations={"k": value})).spec.trainer.pod.annotations
