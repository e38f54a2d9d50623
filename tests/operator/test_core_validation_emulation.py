"""The emulated API server validates the built-in objects the operator creates as
kube-apiserver does (core_validation.py): a pod a real cluster refuses with a 422 is
refused here too, instead of reaching a kubelet that runs it anyway."""

from __future__ import annotations

import copy
import glob
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from jobs import job_doc
from kube_emulator import ApiStatus, Emulator, Route

from rlft.operator import plan as P
from rlft.trainer.config import parse_job
from rlft.trainer.config.files import JobFileError

REPO = Path(__file__).resolve().parents[2]


def _pod(**container: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "python", **container}],
        },
    }


def _create(emulator: Emulator, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
    return emulator._write_create(emulator.types[("", plural)], "default", copy.deepcopy(obj))[0]


def _refusal(emulator: Emulator, plural: str, obj: dict[str, Any]) -> str:
    with pytest.raises(ApiStatus) as refused:
        _create(emulator, plural, obj)
    assert refused.value.code == 422
    assert refused.value.reason == "Invalid"
    return refused.value.message


def test_an_env_value_from_with_no_source_or_a_field_the_downward_api_lacks_is_refused():
    emulator = Emulator()
    assert "must specify one of: `fieldRef`" in _refusal(
        emulator, "pods", _pod(env=[{"name": "X", "valueFrom": {}}])
    )
    message = _refusal(
        emulator,
        "pods",
        _pod(env=[{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.phase"}}}]),
    )
    assert message.startswith(
        'Pod "p" is invalid: spec.containers[0].env[0].valueFrom.fieldRef.fieldPath: '
        'Unsupported value: "status.phase"'
    )
    two = {"fieldRef": {"fieldPath": "metadata.name"}, "secretKeyRef": {"name": "s", "key": "k"}}
    assert "may not have more than one field" in _refusal(
        emulator, "pods", _pod(env=[{"name": "X", "valueFrom": two}])
    )
    assert "secretKeyRef.key: Required value" in _refusal(
        emulator, "pods", _pod(env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s"}}}])
    )
    served = [
        {"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
    ]
    assert _create(emulator, "pods", _pod(env=served))["metadata"]["uid"]


def test_volumes_mounts_and_ports_must_be_unique_and_mounts_name_a_volume():
    emulator = Emulator()
    pod = _pod(
        volumeMounts=[
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": "/tmp"},
            {"name": "nowhere", "mountPath": "/x"},
        ],
        ports=[
            {"name": "http", "containerPort": 80},
            {"name": "http", "containerPort": 81},
            {"name": "much-too-long-port-name", "containerPort": 82},
        ],
    )
    pod["spec"]["volumes"] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
    ]
    message = _refusal(emulator, "pods", pod)
    for expected in (
        'spec.volumes[1].name: Duplicate value: "tmp"',
        'spec.containers[0].volumeMounts[1].mountPath: Invalid value: "/tmp": must be unique',
        'spec.containers[0].volumeMounts[2].name: Not found: "nowhere"',
        'spec.containers[0].ports[1].name: Duplicate value: "http"',
        "spec.containers[0].ports[2].name: Invalid value: "
        '"much-too-long-port-name": must be no more than 15 characters',
    ):
        assert expected in message


def test_probe_thresholds_resources_and_names_are_checked():
    emulator = Emulator()
    probe = {"httpGet": {"path": "/", "port": 80}, "successThreshold": 2}
    assert "livenessProbe.successThreshold: Invalid value: 2: must be 1" in _refusal(
        emulator, "pods", _pod(livenessProbe=probe)
    )
    assert _create(emulator, "pods", _pod(readinessProbe=probe))  # readiness may need 2
    over = {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}
    assert 'requests[cpu]: Invalid value: "2": must be less than or equal to cpu limit' in (
        _refusal(emulator, "pods", {**_pod(resources=over), "metadata": {"name": "q"}})
    )
    gpus = {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}}
    assert "must be equal to nvidia.com/gpu limit of 2" in _refusal(
        emulator, "pods", {**_pod(resources=gpus), "metadata": {"name": "g"}}
    )
    bad = _pod()
    bad["metadata"]["labels"] = {"rlft.dev/job": "x" * 64}
    bad["spec"]["subdomain"] = "has.dots"
    message = _refusal(emulator, "pods", bad)
    assert "metadata.labels: Invalid value" in message and "must be no more than 63" in message
    assert 'spec.subdomain: Invalid value: "has.dots"' in message
    service = {"metadata": {"name": "9-svc"}, "spec": {"ports": [{"port": 80}, {"port": 81}]}}
    message = _refusal(emulator, "services", service)
    assert 'metadata.name: Invalid value: "9-svc": a DNS-1035 label' in message
    assert "spec.ports[0].name: Required value" in message
    big = {"metadata": {"name": "big"}, "data": {"job.yaml": "x" * (1024 * 1024 + 1)}}
    assert "Too long: must have at most 1048576 bytes" in _refusal(emulator, "configmaps", big)


def test_a_pods_spec_is_immutable_but_for_its_binding_and_images():
    emulator = Emulator()
    rt = emulator.types[("", "pods")]
    created = _create(emulator, "pods", _pod(env=[{"name": "A", "value": "1"}]))
    bound = emulator._write_patch(
        rt,
        _route("p"),
        {"spec": {"nodeName": "node-a"}},
        "application/strategic-merge-patch+json",
        "Strict",
    )[0]
    assert bound["spec"]["nodeName"] == "node-a"
    for change in (
        {"spec": {"nodeName": "node-b"}},
        {"spec": {"restartPolicy": "Always"}},
        {"spec": {"containers": [{"name": "main", "image": "python", "env": []}]}},
    ):
        with pytest.raises(ApiStatus) as refused:
            emulator._write_patch(rt, _route("p"), change, "application/merge-patch+json", "Strict")
        assert refused.value.code == 422
        assert "spec: Forbidden: pod updates may not change fields other than" in (
            refused.value.message
        )
    image = {
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "python:2",
                    "env": created["spec"]["containers"][0]["env"],
                }
            ]
        }
    }
    assert emulator._write_patch(rt, _route("p"), image, "application/merge-patch+json", "Strict")[
        0
    ]


def _route(name: str) -> Route:
    return Route("", "v1", "pods", "default", name, None)


def test_every_object_the_operator_plans_for_the_examples_is_accepted():
    seen = 0
    for path in sorted(glob.glob(str(REPO / "examples" / "*.yaml"))):
        emulator = Emulator()
        text = Path(path).read_text()
        # The accounts its comments tell the user to create: a pod naming another is
        # refused (403) by the ServiceAccount admission, as on a cluster.
        for account in re.findall(r"kubectl create serviceaccount ([\w.-]+)", text):
            _create(emulator, "serviceaccounts", {"metadata": {"name": account}})
        for doc in yaml.safe_load_all(text):
            if not doc or doc.get("kind") != "RLFineTune":
                continue
            for obj in P.plan(parse_job(doc), "default", "0f0e0f0e-1111-2222-3333-444455556666"):
                plural = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps",
                          "Secret": "secrets"}.get(obj["kind"])  # fmt: skip
                if plural:
                    assert _create(emulator, plural, obj)["metadata"]["uid"]
                    seen += 1
    assert seen >= 10


@pytest.mark.parametrize(
    "value_from",
    [
        {},
        {"fieldRef": {"fieldPath": "status.phase"}},
        {"secretKeyRef": {"name": "s"}},
        {"fieldRef": {"fieldPath": "metadata.name"}, "configMapKeyRef": {"name": "c", "key": "k"}},
    ],
)
def test_a_job_env_value_from_the_api_server_refuses_is_refused_by_the_job_file(value_from):
    """Else every trainer pod create would be refused (422) on a real cluster, and the job
    would wait with Created=False, while the lenient emulator used to run it."""
    doc = job_doc(trainer={"env": [{"name": "X", "valueFrom": value_from}]})
    with pytest.raises(JobFileError, match="env X: valueFrom"):
        parse_job(doc)
    good = job_doc(
        trainer={"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}
    )
    pods = [o for o in P.plan(parse_job(good), "default", "0f0e-uid") if o["kind"] == "Pod"]
    emulator = Emulator()
    assert all(_create(emulator, "pods", pod) for pod in pods)


def test_a_create_in_a_namespace_that_does_not_exist_is_refused_as_kube_apiserver_does():
    emulator = Emulator()
    secret = {"metadata": {"name": "s", "namespace": "missing"}}
    with pytest.raises(ApiStatus) as refused:
        emulator._write_create(emulator.types[("", "secrets")], "missing", secret)
    assert refused.value.code == 404
    assert 'namespaces "missing" not found' in str(refused.value)
    emulator._write_create(
        emulator.types[("", "namespaces")], None, {"metadata": {"name": "missing"}}
    )
    assert emulator._write_create(emulator.types[("", "secrets")], "missing", secret)[0]


def test_a_pod_naming_a_service_account_that_does_not_exist_is_refused():
    emulator = Emulator()
    emulator._write_create(emulator.types[("", "namespaces")], None, {"metadata": {"name": "ml"}})
    # The controller's part: each new namespace has its `default` account.
    assert ("", "serviceaccounts", "ml", "default") in emulator.store
    pod = {
        "metadata": {"name": "p", "namespace": "ml"},
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }
    created = emulator._write_create(emulator.types[("", "pods")], "ml", copy.deepcopy(pod))[0]
    assert created["spec"]["serviceAccountName"] == "default"
    named = copy.deepcopy(pod)
    named["metadata"]["name"] = "q"
    named["spec"]["serviceAccountName"] = "rlft-s3"
    with pytest.raises(ApiStatus) as refused:
        emulator._write_create(emulator.types[("", "pods")], "ml", copy.deepcopy(named))
    assert refused.value.code == 403
    assert 'error looking up service account ml/rlft-s3: serviceaccount "rlft-s3" not found' in (
        str(refused.value)
    )
    account = {"metadata": {"name": "rlft-s3", "namespace": "ml"}}
    emulator._write_create(emulator.types[("", "serviceaccounts")], "ml", account)
    assert emulator._write_create(emulator.types[("", "pods")], "ml", named)[0]["metadata"]["uid"]


def test_a_pod_created_with_scheduling_gates_is_marked_gated_as_the_api_server_does():
    """kube-apiserver's PrepareForCreate gives a gated pod PodScheduled=False, reason
    SchedulingGated (what the operator tells from Unschedulable: a queued gang)."""
    emulator = Emulator()
    gated = _pod()
    gated["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    (condition,) = _create(emulator, "pods", gated)["status"]["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "PodScheduled",
        "False",
        "SchedulingGated",
    )
    assert (
        "conditions"
        not in _create(
            emulator, "pods", {**_pod(), "metadata": {"name": "q", "namespace": "default"}}
        )["status"]
    )
