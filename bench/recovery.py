"""Recovery from faults on the test cluster, measured: one row per fault.

The test cluster of `tests/cluster/` (emulated API server, process kubelets whose pods are
real processes, SeaweedFS, the real operator) runs the tiny GRPO job on 2 trainer pods
with a checkpoint every 2 steps. For each fault the bench waits for a committed
checkpoint and a few more steps, injects the fault into the running processes and
measures:

- MTTR: seconds from the fault to the next step completed by the restarted job (a new
  line in rank 0's metrics.jsonl);
- its floor: seconds a cold start of the same job from the same checkpoint takes to its
  first completed step (a new RLFineTune resuming from a copy of the location, applied
  the same way, measured in this run);
- steps lost: the last step the old attempt completed minus the step resumed from;
- restarts counted by the operator.

Faults measured: a trainer's worker process SIGKILLed mid-step, a trainer container
SIGKILLed, and a trainer pod deleted (SIGTERM, emergency checkpoint in its grace, as a
preemption or a drain does). Not measured yet: the rest of the fault matrix (node loss,
object store outage, OOM, operator restart, rollout pod kill, collapse) and the goodput
run; the JSON line says so. Last line: JSON with the rows and `goals_met`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / p) for p in ("cluster", "integration", "")]

from cluster_jobs import ALGORITHMS, NS, rlft, tiny_job  # noqa: E402
from seaweedfs import SeaweedServer  # noqa: E402
from testcluster import ProcessCluster, wait_for  # noqa: E402

STEPS, INTERVAL = 40, 2
GOAL_MTTR_OVER_FLOOR = 1.5


def job(name: str, bucket: str, steps: int = STEPS) -> dict[str, Any]:
    doc = tiny_job(name, bucket, ALGORITHMS["grpo"])
    doc["spec"]["trainer"]["steps"] = steps
    doc["spec"]["checkpoint"]["intervalSteps"] = INTERVAL
    doc["spec"]["restartPolicy"] = {"backoffSeconds": 1, "maxRestarts": 5}
    return doc


def metrics(cluster: ProcessCluster, pod: str) -> list[dict[str, Any]]:
    """Rank 0's metrics.jsonl in `pod`'s current folder (empty if that is not rank 0)."""
    folder = cluster.pod_folder(NS, pod)
    files = list((folder / "volumes").rglob("metrics.jsonl")) if folder else []
    if not files:
        return []
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def rank0_steps(cluster: ProcessCluster, name: str) -> list[int]:
    for pod in (f"{name}-trainer-0", f"{name}-trainer-1"):
        rows = metrics(cluster, pod)
        if rows:
            return [int(r["step"]) for r in rows]
    return []


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        path = task / "children"
        found += [int(c) for c in path.read_text().split()] if path.exists() else []
    return found


def inject(cluster: ProcessCluster, fault: str, name: str) -> None:
    pod = f"{name}-trainer-0"
    if fault == "worker SIGKILL":
        os.kill(children(cluster.container_pid(NS, pod))[0], signal.SIGKILL)
    elif fault == "container SIGKILL":
        cluster.kill_container(NS, pod)
    elif fault == "pod deleted (SIGTERM)":
        cluster.kubectl("delete", "pod", pod, "-n", NS, "--wait=false")
    else:
        raise ValueError(fault)


def first_new_step(
    cluster: ProcessCluster,
    name: str,
    old_uids: set[str],
    old_folders: list[Path | None],
    last_step: int,
    timeout: float,
):
    """(seconds waited, first step, step resumed from, the old attempt's last step) for
    rank 0's first step in a pod started after the fault. The old attempt may finish a
    step after the fault (SIGTERM: it checkpoints it), read while its folders exist."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        for folder in old_folders:
            for file in (folder / "volumes").rglob("metrics.jsonl") if folder else []:
                steps = [step for x in _lines(file) if (step := _step(x)) is not None]
                last_step = max([last_step, *steps])
        for pod in (f"{name}-trainer-0", f"{name}-trainer-1"):
            current = cluster.pod(NS, pod)
            if current is None or current["metadata"]["uid"] in old_uids:
                continue
            rows = metrics(cluster, pod)
            resumed = _resumed_step(cluster.logs(NS, pod))
            new = [r for r in rows if resumed is None or int(r["step"]) > resumed]
            if new:
                return time.monotonic() - started, int(new[0]["step"]), resumed, last_step
        time.sleep(0.1)
    raise TimeoutError(f"{name}: no step after the fault in {timeout:.0f} s")


def _lines(file: Path) -> list[str]:
    try:
        return [line for line in file.read_text().splitlines() if line.strip()]
    except OSError:  # removed with its pod
        return []


def _step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError):  # a line still being written
        return None


def _resumed_step(log: str) -> int | None:
    marker = "resumed from the checkpoint of step "
    return int(log.rsplit(marker, 1)[1].split()[0]) if marker in log else None


def trainer_uids(cluster: ProcessCluster, name: str) -> set[str]:
    pods = [cluster.pod(NS, f"{name}-trainer-{i}") for i in (0, 1)]
    return {p["metadata"]["uid"] for p in pods if p}


def measure(cluster: ProcessCluster, store: SeaweedServer, fault: str, k: int) -> dict:
    bucket, name = f"recovery-{k}", f"fault-{k}"
    store.create_bucket(bucket)
    cluster.apply(job(name, bucket))
    wait_for(
        lambda: len(rank0_steps(cluster, name)) >= 2 * INTERVAL + 1,
        f"{name}: a checkpoint and more steps",
        timeout=600,
        every=0.2,
    )
    before = trainer_uids(cluster, name)
    old_folders = [cluster.pod_folder(NS, f"{name}-trainer-{i}") for i in (0, 1)]
    last_step = max(rank0_steps(cluster, name))
    inject(cluster, fault, name)
    mttr, first, resumed, last_step = first_new_step(
        cluster, name, before, old_folders, last_step, timeout=600
    )
    done = wait_for(
        lambda: (
            (rlft(cluster, name) or {}).get("status", {}).get("phase") in ("Succeeded", "Failed")
            and rlft(cluster, name)
        ),
        f"{name} to finish",
        timeout=600,
        every=1,
    )
    status = done["status"]
    floor = cold_start(cluster, store, bucket, name, resumed or 0, k)
    return {
        "fault": fault,
        "mttr_s": round(mttr, 1),
        "floor_s": round(floor, 1),
        "mttr_over_floor": round(mttr / floor, 2),
        "steps_lost": last_step - (resumed or 0),
        "resumed_from": resumed,
        "first_step_after": first,
        "restarts": status.get("restarts", 0),
        "rollbacks": status.get("rollbacks", 0),
        "phase": status["phase"],
    }


def cold_start(cluster, store, bucket: str, name: str, step: int, k: int) -> float:
    """A new job resuming from a copy of `name`'s checkpoint of `step`: time from apply to
    its first completed step (the same pods, images and resume a restart goes through)."""
    client = store.client()
    source, target = f"{name}/step-{step:06d}/", f"cold-{k}/step-{step:06d}/"
    for item in client.list_objects_v2(Bucket=bucket, Prefix=source).get("Contents", []):
        key = item["Key"]
        client.copy_object(
            Bucket=bucket,
            Key=target + key[len(source) :],
            CopySource={"Bucket": bucket, "Key": key},
        )
    client.put_object(Bucket=bucket, Key=f"cold-{k}/latest", Body=f"step-{step:06d}".encode())
    cold = f"cold-{k}"
    started = time.monotonic()
    cluster.apply(job(cold, bucket))
    wait_for(lambda: rank0_steps(cluster, cold), f"{cold}: its first step", 600, every=0.1)
    seconds = time.monotonic() - started
    cluster.kubectl("delete", "rlft", cold, "-n", NS, "--wait=false")
    wait_for(
        lambda: (
            not any(cluster.pod(NS, f"{cold}-{p}") for p in ("trainer-0", "trainer-1", "rollout-0"))
        ),
        f"{cold}'s pods to go",
        120,
    )
    return seconds


def main() -> int:
    faults = ["worker SIGKILL", "container SIGKILL", "pod deleted (SIGTERM)"]
    workdir = Path(tempfile.mkdtemp(prefix="rlft-recovery-"))
    store = SeaweedServer(workdir / "seaweedfs", workdir / "seaweedfs.log")
    store.start()
    rows = []
    try:
        with ProcessCluster(workdir / "cluster", nodes=2) as cluster:
            cluster.install_operator(NS, store.credentials(), secret="s3-creds")
            print(
                f"{'fault':24} {'MTTR s':>7} {'floor s':>8} {'ratio':>6} {'lost':>5} "
                f"{'restarts':>8} {'rollbacks':>9}  phase"
            )
            for k, fault in enumerate(faults):
                row = measure(cluster, store, fault, k)
                rows.append(row)
                print(
                    f"{fault:24} {row['mttr_s']:7.1f} {row['floor_s']:8.1f} "
                    f"{row['mttr_over_floor']:6.2f} {row['steps_lost']:5d} {row['restarts']:8d} "
                    f"{row['rollbacks']:9d}  {row['phase']}",
                    flush=True,
                )
    finally:
        store.stop()
    goals = {
        "mttr_within_1.5x_floor": all(r["mttr_over_floor"] <= GOAL_MTTR_OVER_FLOOR for r in rows),
        "steps_lost_within_interval": all(r["steps_lost"] <= INTERVAL for r in rows),
        "all_succeeded": all(r["phase"] == "Succeeded" for r in rows),
    }
    print(
        json.dumps(
            {
                "rows": rows,
                "checkpoint_interval": INTERVAL,
                "goals": goals,
                "goals_met": all(goals.values()),
                "not_measured": ["the other fault-matrix rows", "goodput", "data exactly once"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
