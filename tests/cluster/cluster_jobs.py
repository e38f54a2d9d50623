"""Jobs for the test cluster and what the tests read back from it: manifests, the
RLFineTune's status through kubectl, Prometheus targets, held-out accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from cluster_images import environment_of
from testcluster import ProcessCluster, wait_for
from tiny_jobs import TINY_INIT
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlft.operator import names as N
from rlft.trainer.config import load_job
from rlft.trainer.data import build_task
from rlft.trainer.model.construct import from_pretrained
from rlft.trainer.model.encoding import Encoder
from rlft.trainer.model.tokenizer import stop_token_ids
from rlft.trainer.rollout import TransformersEngine
from rlft.trainer.run.evaluate import greedy_accuracy

ROOT = Path(__file__).resolve().parents[2]
NS = "ml"
VLLM_IMAGE = "ghcr.io/rlft/rollout-vllm:latest"
"""Mapped to `.venv-vllm` by the kubelets (cluster_images.py)."""


def vllm_image() -> str:
    """VLLM_IMAGE, once its environment is there: without it the pod waits in
    ErrImagePull and the test would time out instead of saying why."""
    assert environment_of(VLLM_IMAGE) is not None, "run `make vllm` (builds .venv-vllm)"
    return VLLM_IMAGE


def pod_targets(cluster: ProcessCluster) -> list[dict[str, Any]]:
    """What a PodMonitor selects: the job pods' `status` and `http` ports, from the API
    server (Debian's Prometheus has no Kubernetes discovery built in, so the test finds
    the pods and hands Prometheus a file_sd file)."""
    groups = []
    for pod in cluster.api.list("pods", NS):
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or "rlft.dev/job" not in (pod["metadata"].get("labels") or {}):
            continue
        for container in pod["spec"]["containers"]:
            for port in container.get("ports") or []:
                if port.get("name") in ("status", "http"):
                    groups.append(
                        {
                            "targets": [f"{ip}:{port['containerPort']}"],
                            "labels": {"pod": pod["metadata"]["name"]},
                        }
                    )
    return groups


def tiny_job(
    name: str, bucket: str, algorithm: dict[str, Any], rollout: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "apiVersion": "rlft.dev/v1alpha1",
        "kind": "RLFineTune",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"init": TINY_INIT, "tokenizer": {"kind": "byte"}},
            "data": {"arithmetic": {"digits": 2, "evalSize": 40}},
            "algorithm": {
                "groupSize": 4,
                "sft": {"steps": 20, "batchSize": 16, "learningRate": 0.003},
                **algorithm,
            },
            "trainer": {
                "steps": 6,
                "promptsPerStep": 4,
                "microBatchSize": 8,
                "replicas": {"min": 2, "max": 2},
                # Tiny models: keep gathered weights to the backward (half the gathers).
                "parallelism": {"reshardAfterForward": False},
                # A CPU each: the operator gives the ranks OMP_NUM_THREADS=1, so two ranks
                # on a 2-core machine do not run 4 threads.
                "resources": {"requests": {"cpu": "1"}},
            },
            "rollout": {
                "instances": 1,
                "engine": "transformers",
                "sampling": {"maxNewTokens": 4},
                # No CPU request (the scheduling tests count the trainers' CPUs only), so
                # the operator sets no thread count: one thread, as `rlft train`'s local
                # rollout servers run, instead of torch's one per core spinning beside
                # the ranks on a loaded 2-core machine.
                "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
                **(rollout or {}),
            },
            "checkpoint": {
                "uri": f"s3://{bucket}/{name}",
                "intervalSteps": 2,
                "credentialsSecret": "s3-creds",
                "addressingStyle": "path",
            },
            "eval": {"maxProblems": 20},
        },
    }


def one_trainer_per_node(job: dict[str, Any]) -> None:
    """Each trainer pod asks for 3 of a node's 4 CPUs, so that one fits per node; its
    ranks still run one thread each (the job's own OMP_NUM_THREADS, where the operator
    would give 3 on this 2-core machine)."""
    job["spec"]["trainer"]["resources"] = {"requests": {"cpu": "3"}}
    job["spec"]["trainer"]["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]


EXAMPLE = ROOT / "examples" / "tiny-grpo.yaml"


def warm_start_of_the_example(folder: Path) -> Path:
    """`make run`'s warm start (and its first GRPO step), run here in one process as
    `rlft train`: the Hugging Face folder a user would bring to a cluster job. One
    process does these supervised steps in a fraction of the CPU two ranks need."""
    run = folder / "run"
    command = [sys.executable, "-m", "rlft.trainer.cli.main", "train", str(EXAMPLE)]
    command += ["--out", str(run), "--max-steps", "1"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return run / "model"


def learnable_job(name: str, bucket: str, model_path: str) -> dict[str, Any]:
    """`make run`'s job (examples/tiny-grpo.yaml) from a warm-started model folder at
    `model_path`, 45 RL steps on the cluster: a model big enough that GRPO visibly beats
    its start on held-out problems (two trainer pods here, 2026-12-02: 0.360 → 0.768)."""
    example = yaml.safe_load(EXAMPLE.read_text())
    job = tiny_job(name, bucket, {})
    spec = example["spec"]
    spec["model"] = {"path": model_path}
    spec["algorithm"]["sft"] = {"steps": 0}
    spec["trainer"] |= {"steps": 45, "replicas": {"min": 2, "max": 2}}
    spec["trainer"]["resources"] = job["spec"]["trainer"]["resources"]
    spec["rollout"] = job["spec"]["rollout"] | {"sampling": spec["rollout"]["sampling"]}
    spec["checkpoint"] = job["spec"]["checkpoint"] | {"intervalSteps": 20}
    return job | {"spec": spec}


def mount_a_claim(
    cluster: ProcessCluster, job: dict[str, Any], folder: Path, claim: str, at: str
) -> None:
    """`folder` as a hostPath PersistentVolume, bound to the claim `claim`, mounted
    read-only at `at` in the job's trainer and rollout pods (through `spec.<role>.pod`):
    how a user brings a model and data that are not in the image."""
    cluster.api.create(
        "persistentvolumes",
        None,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{claim}-volume"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "hostPath": {"path": str(folder)},
            },
        },
    )
    cluster.api.create(
        "persistentvolumeclaims",
        NS,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": NS},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "resources": {"requests": {"storage": "1Gi"}},
                "volumeName": f"{claim}-volume",
            },
        },
    )
    volume = {"name": "assets", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    pod = {"volumes": [volume], "volumeMounts": [{"name": "assets", "mountPath": at}]}
    job["spec"]["trainer"]["pod"] = pod
    job["spec"]["rollout"]["pod"] = pod


def held_out_accuracy(job: dict[str, Any], model_dir: Path, tmp_path: Path) -> float:
    """Greedy exact match of a model folder on the job's held-out problems, computed
    here with the trainer's own task and evaluation code."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    spec = load_job(tmp_path / "job.yaml").spec
    model = from_pretrained(AutoModelForCausalLM, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(tokenizer)
    encoder = Encoder(tokenizer, spec.data, int(stops[0]))
    problems = build_task(spec.data, spec.trainer.seed).eval_problems()[: spec.eval.max_problems]
    engine = TransformersEngine(model, encoder.pad_id, stops)
    max_new_tokens = spec.rollout.sampling.max_new_tokens
    return greedy_accuracy(engine, problems, encoder.prompt, encoder.decode, max_new_tokens)


def finished(cluster: ProcessCluster, name: str) -> dict[str, Any] | None:
    job = rlft(cluster, name) or {}
    return job if (job.get("status") or {}).get("phase") in ("Succeeded", "Failed") else None


def rlft(cluster: ProcessCluster, name: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", "rlft", name, "-n", NS, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


ALGORITHMS = {
    "grpo": {"name": "grpo"},
    "ppo": {"name": "ppo"},
    "dpo": {"name": "dpo", "dpo": {"pairsPerStep": 4}},
}


def end_every_job(cluster: ProcessCluster, timeout: float = 180.0) -> None:
    """Delete every RLFineTune and wait until the pods of each are gone. Pods share the
    machine's network here (README: one job at a time): a job's trainer still stopping
    holds the rendezvous and /status ports, which the next job's trainer-0 then could not
    bind (EADDRINUSE: a lost rendezvous, a restart) and the operator polled the old one."""
    listed = cluster.kubectl("get", "rlft", "-A", "-o", "json", check=False)
    jobs = json.loads(listed.stdout)["items"] if listed.returncode == 0 else []
    for job in jobs:
        meta = job["metadata"]
        # check=False: a job the test deleted itself may be gone since it was listed.
        cluster.kubectl(
            "delete", "rlft", meta["name"], "-n", meta["namespace"], "--wait=false", check=False
        )

    def jobs_pods() -> list[str]:
        return [
            f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for p in cluster.api.list("pods")
            if N.LABEL_JOB in (p["metadata"].get("labels") or {})
        ]

    wait_for(lambda: not jobs_pods(), "the jobs' pods to be gone", timeout, every=0.5)
