"""`kubectl apply` of an RLFineTune on the test cluster: the real operator plans the pods,
the process kubelets run them (torchrun, `rlft train`, `rlft rollout`), SeaweedFS is the
cluster's object store with credentials from a Secret. Nothing plays the trainer."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_fixtures import Prometheus, start_prometheus, stop_prometheus
from seaweedfs import ACCESS_KEY, SECRET_KEY
from testcluster import ProcessCluster, wait_for
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "operator"))

from tiny_jobs import TINY_INIT  # noqa: E402

NS = "ml"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("jobs-cluster"), nodes=2) as running:
        credentials = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": seaweed.endpoint,
        }
        running.install_operator(NS, credentials, secret="s3-creds")
        yield running


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


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory) -> Iterator[Prometheus]:
    """A real Prometheus scraping the job pods' /metrics every second."""
    folder = tmp_path_factory.mktemp("prometheus")
    targets = folder / "pods.json"
    targets.write_text("[]")
    scrape = {
        "job_name": "rlft-pods",
        "scrape_interval": "1s",
        "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
    }
    server = start_prometheus(folder, [], [], [scrape])
    stop = threading.Event()

    def discover() -> None:
        while not stop.wait(0.5):
            with contextlib.suppress(OSError, ValueError):
                fresh = folder / "pods.json.tmp"
                fresh.write_text(json.dumps(pod_targets(cluster)))
                fresh.replace(targets)

    thread = threading.Thread(target=discover, daemon=True)
    thread.start()
    yield server
    stop.set()
    thread.join(timeout=5)
    stop_prometheus(server)


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
            },
            "rollout": {
                "instances": 1,
                "engine": "transformers",
                "sampling": {"maxNewTokens": 4},
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


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_job_with_two_trainer_pods_trains_and_succeeds(
    cluster, seaweed, prometheus, algorithm, tmp_path
):
    bucket = f"cluster-{algorithm}"
    seaweed.create_bucket(bucket)
    name = f"tiny-{algorithm}"
    cluster.apply(tiny_job(name, bucket, ALGORITHMS[algorithm]))
    seen_steps: list[int] = []
    seen_checkpoint = []
    deadline = time.monotonic() + 600
    phase = None
    while time.monotonic() < deadline:
        job = rlft(cluster, name) or {}
        status = job.get("status") or {}
        phase = status.get("phase")
        if status.get("step") is not None:
            seen_steps.append(status["step"])
        if status.get("lastCheckpoint"):
            seen_checkpoint.append(status["lastCheckpoint"])
        if phase in ("Succeeded", "Failed"):
            break
        time.sleep(1)
    logs = {
        pod: cluster.logs(NS, f"{name}-{pod}") for pod in ("trainer-0", "trainer-1", "rollout-0")
    }
    assert phase == "Succeeded", json.dumps(rlft(cluster, name), indent=1) + "\n".join(
        f"--- {pod}\n{text[-3000:]}" for pod, text in logs.items()
    )
    trainer_logs = logs["trainer-0"] + logs["trainer-1"]
    assert "rank 0 of world size 2" in trainer_logs and "rank 1 of world size 2" in trainer_logs
    assert seen_steps and max(seen_steps) > min(seen_steps), seen_steps
    assert seen_checkpoint, "kubectl get rlft never showed a checkpoint"
    client = seaweed.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{name}/")["Contents"]]
    shards = {k.rsplit("/", 1)[-1] for k in keys if k.endswith(".distcp")}
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards, keys
    assert f"{name}/outputs/summary.json" in keys and f"{name}/outputs/model/config.json" in keys
    summary = json.loads(
        client.get_object(Bucket=bucket, Key=f"{name}/outputs/summary.json")["Body"].read()
    )
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["algorithm"] == algorithm and summary["policy_version"] >= 1
    # The final model, read back from the object store, loads with transformers.
    model_dir = tmp_path / "model"
    for key in keys:
        if key.startswith(f"{name}/outputs/model/"):
            target = model_dir / key.removeprefix(f"{name}/outputs/model/")
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.hidden_size == TINY_INIT["hiddenSize"]
    rollout_pod_ran = bool(logs["rollout-0"])
    assert rollout_pod_ran == (algorithm != "dpo")  # DPO samples nothing: no rollout pods
    # The real Prometheus scraped the trainer's and the rollout pod's /metrics.
    window = "max_over_time({}[10m])"
    steps = prometheus.query(window.format(f'rlft_train_step{{pod=~"{name}-trainer-.*"}}'))
    assert steps and max(float(s["value"][1]) for s in steps) >= 1, steps
    if rollout_pod_ran:
        served = prometheus.query(
            window.format(f'rlft_rollout_requests_total{{pod="{name}-rollout-0"}}')
        )
        assert served and float(served[0]["value"][1]) > 0, served


def test_a_grpo_job_with_its_rollout_instance_on_vllm_succeeds(cluster, seaweed):
    """The rollout pod's image maps to `.venv-vllm`: `rlft rollout` serves with vLLM."""
    bucket, name = "cluster-vllm", "tiny-vllm"
    seaweed.create_bucket(bucket)
    rollout = {"engine": "vllm", "image": "ghcr.io/rlft/rollout-vllm:latest"}
    job = tiny_job(name, bucket, ALGORITHMS["grpo"], rollout)
    # vLLM's CPU attention needs heads of 32 dimensions or more
    job["spec"]["model"]["init"] = TINY_INIT | {"hiddenSize": 64, "numKvHeads": 1}
    cluster.apply(job)
    job = wait_for(
        lambda: (
            (rlft(cluster, name) or {}).get("status", {}).get("phase") in ("Succeeded", "Failed")
            and rlft(cluster, name)
        ),
        f"{name} to finish",
        timeout=600,
        every=2,
    )
    rollout_log = cluster.logs(NS, f"{name}-rollout-0")
    assert job["status"]["phase"] == "Succeeded", (
        rollout_log[-3000:] + cluster.logs(NS, f"{name}-trainer-0")[-3000:]
    )
    assert "(vllm)" in rollout_log


def test_a_missing_credentials_secret_is_named_and_nothing_crash_loops(cluster):
    name = "no-creds"
    job = tiny_job(name, "cluster-nowhere", ALGORITHMS["grpo"])
    job["spec"]["checkpoint"]["credentialsSecret"] = "missing-s3-creds"

    def ready_condition() -> dict[str, Any] | None:
        conditions = ((rlft(cluster, name) or {}).get("status") or {}).get("conditions") or []
        found = [c for c in conditions if c["type"] == "Ready" and c["status"] == "False"]
        return found[0] if found and "missing-s3-creds" in found[0].get("message", "") else None

    cluster.apply(job)
    condition = wait_for(ready_condition, "a Ready=False condition naming the Secret", 60)
    assert 'secret "missing-s3-creds" not found' in condition["message"]
    events = [e for e in cluster.api.list("events", NS) if e["involvedObject"]["name"] == name]
    assert any('secret "missing-s3-creds" not found' in e["message"] for e in events), events
    time.sleep(3)  # a few reconciles later: still waiting, nothing restarted
    status = rlft(cluster, name)["status"]
    assert status.get("restarts", 0) == 0 and status["phase"] not in ("Failed", "Restarting")
    for pod in cluster.api.list("pods", NS):
        if pod["metadata"]["name"].startswith(f"{name}-"):
            (container,) = pod["status"]["containerStatuses"]
            assert container["restartCount"] == 0
            assert container["state"]["waiting"]["reason"] == "CreateContainerConfigError"
    cluster.kubectl("delete", "rlft", name, "-n", NS, "--wait=false")
    wait_for(
        lambda: (
            not [
                p
                for p in cluster.api.list("pods", NS)
                if p["metadata"]["name"].startswith(f"{name}-")
            ]
        ),
        f"the pods of {name} to go",
        timeout=60,
    )
