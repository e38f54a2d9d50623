"""What the fault tests and `bench/recovery.py` share: the faulty job, where its processes
are, and what a run kept (the history in `outputs/metrics.jsonl`), checked against an
uninterrupted run of the same job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml
from cluster_jobs import ALGORITHMS, NS, rlft, tiny_job
from testcluster import ProcessCluster, wait_for


def faulty_job(name: str, bucket: str, steps: int = 12) -> dict[str, Any]:
    """The tiny GRPO job on 2 trainer pods, restarted fast and often enough to see
    several faults through."""
    job = tiny_job(name, bucket, ALGORITHMS["grpo"])
    job["spec"]["trainer"]["steps"] = steps
    job["spec"]["restartPolicy"] = {"backoffSeconds": 1, "maxRestarts": 5}
    return job


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        path = task / "children"
        found += [int(child) for child in path.read_text().split()] if path.exists() else []
    return found


def worker_of(cluster: ProcessCluster, pod: str) -> int:
    """The `rlft train` worker torchrun started (torchrun runs under `rlft scrubbed`, the
    container's process)."""
    first = cluster.container_pid(NS, pod)
    agent = wait_for(lambda: children(first), f"{pod}'s torchrun agent", 60)[0]
    return wait_for(lambda: children(agent), f"a worker under {pod}'s agent", 60)[0]


ALLOCATE = """
import os, sys, time
group, size = sys.argv[1], int(sys.argv[2])
with open(os.path.join(group, "cgroup.procs"), "w") as procs:
    procs.write(str(os.getpid()))
held = [b"\\x01" * (16 << 20) for _ in range(size // (16 << 20) + 1)]
time.sleep(2)
"""


def start_oom(cluster: ProcessCluster, pod: str) -> subprocess.Popen:
    """Push `pod`'s container over its memory limit: a process joins its real memory
    cgroup and allocates more than the whole limit, so the cgroup goes over it whatever
    the trainer holds at that moment (what it held when measured can be freed before the
    allocation ends: buffers of a checkpoint just written). The trainer's worker is made
    the OOM killer's first choice (oom_score_adj 1000, what a kubelet gives a BestEffort
    container; lowering the allocator's own needs CAP_SYS_RESOURCE). The worker is
    stopped (SIGSTOP) first, so it is still there, in its cgroup, when the allocation
    fills it: a tiny job can otherwise end within the second the allocator takes, and
    the kernel then kills the allocator alone. Returns the allocator, which is killed
    too once the worker's memory is freed."""
    folder = cluster.pod_folder(NS, pod)
    group = Path(json.loads((folder / "main.sandbox.json").read_text())["cgroup"])
    limit = int((group / "memory.limit_in_bytes").read_text())
    worker = worker_of(cluster, pod)
    Path(f"/proc/{worker}/oom_score_adj").write_text("1000")
    os.kill(worker, signal.SIGSTOP)  # SIGKILL, the OOM killer's signal, still ends it
    size = limit + (256 << 20)
    return subprocess.Popen(
        [sys.executable, "-c", ALLOCATE, str(group), str(size)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def events(cluster: ProcessCluster, name: str) -> list[dict[str, Any]]:
    return [e for e in cluster.api.list("events", NS) if e["involvedObject"]["name"] == name]


def job_status(cluster: ProcessCluster, name: str) -> dict[str, Any]:
    return (rlft(cluster, name) or {}).get("status") or {}


def checkpointed(cluster: ProcessCluster, name: str) -> int | None:
    """The step of the job's last committed checkpoint, as its status shows it."""
    last = job_status(cluster, name).get("lastCheckpoint")
    return last["step"] if last else None


def kept_history(client, bucket: str, name: str) -> list[dict[str, Any]]:
    """The finished run's metrics.jsonl from its outputs: every kept step's record (a
    resumed run's file starts with its checkpoint's history)."""
    body = client.get_object(Bucket=bucket, Key=f"{name}/outputs/metrics.jsonl")["Body"]
    return [json.loads(line) for line in body.read().decode().splitlines() if line.strip()]


def data_sequence(history: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(int(r["step"]), r.get("data_digest")) for r in history]  # None: no batch


def uninterrupted(job: dict[str, Any], folder: Path, steps: int) -> list[tuple[int, str]]:
    """(step, data digest) of the same job run without a fault: `rlft train` here, with
    the job's seed, data, batch and rollout settings (one rank, no checkpoints; which
    prompts a step trains on depends on neither)."""
    local = json.loads(json.dumps(job))
    spec = local["spec"]
    spec["trainer"] |= {"steps": steps, "replicas": {"min": 1, "max": 1}}
    spec.pop("checkpoint")
    spec["algorithm"]["sft"]["steps"] = 1  # the warm start draws from its own stream
    spec["rollout"] |= {"instances": 1, "engine": "transformers"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(local))
    result = subprocess.run(
        [sys.executable, "-m", "rlft.trainer.cli.main", "train", "job.yaml", "--out", "out"],
        cwd=folder,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
    return data_sequence([json.loads(line) for line in lines])


def assert_data_exactly_once(
    history: list[dict[str, Any]], reference: list[tuple[int, str]], steps: int
) -> None:
    """Each step kept once, in order, on the prompts the uninterrupted run trained on:
    no prompt skipped, none trained twice."""
    kept = data_sequence(history)
    assert [step for step, _ in kept] == list(range(1, steps + 1)), kept
    assert kept == reference[:steps], f"kept {kept}\nuninterrupted {reference[:steps]}"
