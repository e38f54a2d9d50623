"""Every file in examples/ is a job a user can `kubectl apply` and `rlft train`: it validates
against the CRD's own schema (as the API server would: unknown fields, OpenAPI schema, CEL
rules), passes `rlft validate`, and the pods the operator would create for it, and every
object `rlft plan` prints for it, are valid Kubernetes objects."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from chart_render import ROOT, kubernetes_validate
from crd_validation import validate
from example_jobs import EXAMPLES, parsed_examples
from example_jobs import document as _document
from jobs import on_cluster

from rlft.operator import manifests as M
from rlft.trainer.cli.main import main

CRD = yaml.safe_load((ROOT / "crds" / "rlfinetune.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
RLFT = str(Path(sys.executable).parent / "rlft")


def test_the_examples_cover_what_users_start_from():
    names = {path.name for path in EXAMPLES}
    assert {"tiny-grpo.yaml", "tiny-dpo.yaml", "qwen3-moe-vllm-gpu.yaml"} <= names
    assert "s3-checkpoints.yaml" in names
    moe = _document(ROOT / "examples" / "qwen3-moe-vllm-gpu.yaml")["spec"]
    assert moe["rollout"]["engine"] == "vllm" and moe["rollout"]["expertParallel"] > 1
    assert moe["trainer"]["gpusPerPod"] > 0 and moe["model"]["path"].startswith("/")
    s3 = _document(ROOT / "examples" / "s3-checkpoints.yaml")["spec"]["checkpoint"]
    assert s3["uri"].startswith("s3://") and s3["credentialsSecret"]


def test_the_gpu_example_reads_its_model_from_a_read_only_claim_in_every_pod():
    """The model folder is on a PVC mounted read-only into the trainer and rollout pods (Ray
    heads and workers included) at the path spec.model.path names; the S3 credentials come
    from a ServiceAccount (IRSA), not a Secret."""
    (job, body), *_ = [
        (j, b) for j, b in parsed_examples(multi_node_rollout=True) if j.metadata.name == "wide"
    ]
    model_path = job.spec.model.path
    pods = M.desired(job, body, M.Settings(), "auto").pods.values()
    assert {p["metadata"]["labels"]["rlft.dev/role"] for p in pods} == {
        "trainer",
        "ray-head",
        "ray-worker",
    }
    for pod in pods:
        spec, (main,) = pod["spec"], pod["spec"]["containers"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]
            for v in spec["volumes"]
            if "persistentVolumeClaim" in v
        }
        (mount,) = [m for m in main["volumeMounts"] if model_path.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True and claims[mount["name"]]["readOnly"] is True
        assert spec["serviceAccountName"] == "rlft-s3"
        assert spec["automountServiceAccountToken"] is False  # IRSA's webhook brings its own
        # No Secret but the job's tokens: the rollout API's where it is called or served,
        # Ray's (with Ray's token authentication on) in the Ray cluster's pods.
        from_secrets = [e["name"] for e in main["env"] if "secretKeyRef" in str(e)]
        expected = {
            "trainer": ["RLFT_ROLLOUT_TOKEN"],
            "ray-head": ["RLFT_ROLLOUT_TOKEN", "RAY_AUTH_TOKEN"],
            "ray-worker": ["RAY_AUTH_TOKEN"],
        }
        assert from_secrets == expected[pod["metadata"]["labels"]["rlft.dev/role"]]
        ray_mode = {"name": "RAY_AUTH_MODE", "value": "token"}
        assert (ray_mode in main["env"]) == (
            pod["metadata"]["labels"]["rlft.dev/role"] != "trainer"
        )
    assert job.spec.checkpoint.credentials_secret is None
    staging = job.spec.checkpoint.staging_dir
    assert staging in {m.mount_path for m in job.spec.trainer.pod.volume_mounts}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_the_crd_schema(path):
    document = on_cluster(_document(path))  # local examples get an s3:// location first
    assert document["apiVersion"] == "rlft.dev/v1alpha1" and document["kind"] == "RLFineTune"
    _, problems, warnings = validate(document, SCHEMA)
    assert problems == [] and warnings == [], [str(p) for p in problems]
    text = path.read_text()
    assert text.lstrip().startswith("#"), f"{path.name}: say what the job is in a comment"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_passes_rlft_validate(path):
    result = subprocess.run([RLFT, "validate", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "valid RLFineTune" in result.stdout


def test_a_broken_example_fails_both_checks(tmp_path):
    document = _document(ROOT / "examples" / "qwen3-moe-vllm-gpu.yaml")
    broken = copy.deepcopy(document)
    broken["spec"]["rollout"]["gpusPerInstance"] = 6  # not divisible by 2 × 4
    broken["spec"]["trainer"]["gpusPerNode"] = 8  # no such field
    _, problems, _ = validate(broken, SCHEMA)
    fields = {p.field for p in problems}
    assert {"spec.trainer.gpusPerNode"} <= fields, fields
    broken["spec"]["trainer"].pop("gpusPerNode")
    _, problems, _ = validate(broken, SCHEMA)
    assert [p.field for p in problems] == ["spec.rollout.gpusPerInstance"]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run([RLFT, "validate", str(path)], capture_output=True, text=True)
    assert result.returncode == 2 and "spec.rollout" in result.stderr, result.stderr


def test_the_pods_of_every_example_are_valid_kubernetes_objects(tmp_path):
    manifests = []
    for job, body in parsed_examples(multi_node_rollout=True):
        manifests += M.desired(job, body, M.Settings(), "auto").all()
    out = tmp_path / "children.yaml"
    out.write_text(yaml.safe_dump_all(manifests))
    tool = str(Path(sys.executable).parent / "kubernetes-validate")
    result = subprocess.run([tool, "--strict", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(manifests)
    gpu_pods = [m for m in manifests if "nvidia.com/gpu" in str(m.get("spec", {}))]
    assert gpu_pods, "the GPU example asks for GPUs"


def test_what_rlft_plan_prints_for_every_example_is_valid(tmp_path, capsys):
    documents = []
    for path in EXAMPLES:
        document = _document(path)
        if document.get("kind") != "RLFineTune":
            continue
        job_file = tmp_path / path.name  # local examples get an s3:// location first
        job_file.write_text(yaml.safe_dump(on_cluster(document), sort_keys=False))
        assert main(["plan", str(job_file), "-n", "ml"]) == 0, capsys.readouterr().err
        printed = list(yaml.safe_load_all(capsys.readouterr().out))
        assert printed and {d["kind"] for d in printed} <= {
            "ConfigMap",
            "Service",
            "Secret",
            "NetworkPolicy",
            "Pod",
        }
        documents += printed
    output = kubernetes_validate(documents, tmp_path)
    assert "Couldn't find schema" not in output  # each object really checked


def test_what_rlft_plan_prints_for_a_job_with_every_pod_setting_is_valid(tmp_path, capsys):
    """spec.<role>.pod and resources.extended, every field, for trainer, Ray head and worker
    pods (tests/operator/pod_jobs.py), through `rlft plan` and `kubernetes-validate --strict`."""
    from pod_jobs import every_pod_setting

    documents = []
    for name, multi_node in (("ray", True), ("single", False)):
        job_file = tmp_path / f"{name}.yaml"
        job_file.write_text(yaml.safe_dump(every_pod_setting(name, multi_node), sort_keys=False))
        assert main(["plan", str(job_file), "-n", "ml"]) == 0, capsys.readouterr().err
        documents += list(yaml.safe_load_all(capsys.readouterr().out))
    pods = [d for d in documents if d["kind"] == "Pod"]
    assert len(pods) == 5 + 2  # trainer, 2 heads, 2 workers; trainer and rollout
    assert all(
        "imagePullSecrets" in p["spec"] and "envFrom" in p["spec"]["containers"][0] for p in pods
    )
    output = kubernetes_validate(documents, tmp_path)
    assert "Couldn't find schema" not in output
