"""Faults injected into running jobs on the test cluster: the real operator, torchrun and
`rlft train` recover by themselves and the job reaches Succeeded. Each test injects its
fault into real processes (by process id, from the kubelet's records)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from cluster_jobs import ALGORITHMS, NS, finished, rlft, tiny_job
from testcluster import ProcessCluster, wait_for


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        children = (task / "children").read_text().split() if (task / "children").exists() else []
        found += [int(child) for child in children]
    return found


def _worker_of(cluster: ProcessCluster, pod: str) -> int:
    """The `rlft train` worker torchrun (the container's process) started."""
    agent = cluster.container_pid(NS, pod)
    workers = wait_for(lambda: _children(agent), f"a worker under {pod}'s agent", 60)
    return workers[0]


def _events(cluster: ProcessCluster, name: str) -> list[dict[str, Any]]:
    return [e for e in cluster.api.list("events", NS) if e["involvedObject"]["name"] == name]


def _faulty_job(name: str, bucket: str, steps: int = 12) -> dict[str, Any]:
    job = tiny_job(name, bucket, ALGORITHMS["grpo"])
    job["spec"]["trainer"]["steps"] = steps
    job["spec"]["restartPolicy"] = {"backoffSeconds": 1, "maxRestarts": 5}
    return job


def test_a_trainer_killed_before_the_first_checkpoint_restarts_from_the_start(cluster, seaweed):
    """SIGKILL of trainer-0's container during the warm start: no checkpoint exists, the
    operator restarts the gang with --resume=latest-healthy, which starts the job again
    (with a warning) instead of failing for want of a checkpoint."""
    bucket, name = "faults-early", "early-kill"
    seaweed.create_bucket(bucket)
    job = _faulty_job(name, bucket)
    job["spec"]["algorithm"]["sft"]["steps"] = 60  # a warm start long enough to hit
    cluster.apply(job)
    pod = f"{name}-trainer-0"
    wait_for(lambda: "[" in cluster.logs(NS, pod), "the warm start to be under way", 180)
    cluster.kill_container(NS, pod)
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    logs = cluster.logs(NS, pod) + cluster.logs(NS, f"{name}-trainer-1")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1) + logs[-4000:]
    assert status["restarts"] >= 1 and status["lastFailure"]["pod"].startswith(f"{name}-")
    assert any(e["reason"] == "Restarting" for e in _events(cluster, name))
    assert "no checkpoint at all; starting from the beginning" in logs
    client = seaweed.client()
    summary = client.get_object(Bucket=bucket, Key=f"{name}/outputs/summary.json")["Body"]
    assert json.loads(summary.read())["steps"] == 12


def test_a_trainer_rank_killed_mid_step_resumes_from_the_last_checkpoint(cluster, seaweed):
    """SIGKILL of trainer-0's worker process (not its pod) after a checkpoint: torchrun restarts
    the workers of both pods, which resume from the newest checkpoint; the job completes
    and no committed checkpoint is lost."""
    bucket, name = "faults-rank", "rank-kill"
    seaweed.create_bucket(bucket)
    job = _faulty_job(name, bucket, steps=16)
    cluster.apply(job)
    pod = f"{name}-trainer-0"

    def checkpointed() -> int | None:
        last = ((rlft(cluster, name) or {}).get("status") or {}).get("lastCheckpoint")
        return last["step"] if last else None

    saved = wait_for(checkpointed, "a committed checkpoint", timeout=300, every=0.5)
    worker = _worker_of(cluster, pod)
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    logs = cluster.logs(NS, pod)
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1) + logs[-4000:]
    assert "resumed from the checkpoint of step" in logs, logs[-4000:]
    resumed = int(logs.split("resumed from the checkpoint of step ")[1].split()[0])
    assert resumed >= saved  # no committed checkpoint lost
    # torchrun restarts nothing (--max-restarts=0): the operator did, and counted it.
    assert status["restarts"] >= 1 and status["lastFailure"]["reason"] in (
        "Error",
        "RendezvousTimeout",
    )
    print(f"recovered {time.monotonic() - killed_at:.1f} s after the kill; resumed at {resumed}")


def test_a_preempted_trainer_pod_checkpoints_in_its_grace_and_the_job_resumes_from_it(
    cluster, seaweed
):
    """`kubectl delete pod` of trainer-0 mid-run (what a preemption or a drain does): the
    kubelet sends SIGTERM, the ranks write an emergency checkpoint inside the grace and
    exit 0 without completing; the operator restarts the gang, which resumes from that
    checkpoint, and the job completes."""
    bucket, name = "faults-preempt", "preempted"
    seaweed.create_bucket(bucket)
    job = _faulty_job(name, bucket, steps=24)
    job["spec"]["checkpoint"]["intervalSteps"] = 1000  # only the emergency one can be used
    cluster.apply(job)
    pod = f"{name}-trainer-0"
    first_uid = wait_for(lambda: cluster.pod(NS, pod), f"{pod} to exist", 60)["metadata"]["uid"]

    def stepping() -> int | None:
        return ((rlft(cluster, name) or {}).get("status") or {}).get("step")

    wait_for(lambda: (stepping() or 0) >= 3, "a few RL steps", timeout=300, every=0.5)
    pods = [pod, f"{name}-trainer-1"]
    first_folders = [cluster.pod_folder(NS, p) for p in pods]  # rank 0 may be either
    cluster.kubectl("delete", "pod", pod, "-n", NS, "--wait=false")
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    first_logs = "".join((f / "main.log").read_text(errors="replace") for f in first_folders)
    stopped = first_logs.split("stopped after the emergency checkpoint of step ")
    assert len(stopped) > 1, first_logs[-3000:]
    step = int(stopped[1].split(";")[0].split()[0])
    assert cluster.pod(NS, pod)["metadata"]["uid"] != first_uid
    again = "".join(cluster.logs(NS, p) for p in pods)
    assert f"resumed from the checkpoint of step {step}" in again, again[-3000:]
