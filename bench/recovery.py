"""Recovery from faults on the test cluster, measured: one row per fault, then goodput.

The test cluster of `tests/cluster/` (emulated API server, process kubelets whose pods are
real processes, SeaweedFS, the real operator) runs the tiny GRPO job on 2 trainer pods
with a checkpoint every 2 steps. For each fault the bench waits for a committed
checkpoint and a few more steps, injects the fault into the running processes and
measures:

- MTTR: seconds from the fault to the next step completed after it (a new line in rank
  0's metrics.jsonl: of a restarted gang, a step past the one it resumed from); for the
  object-store outage, from the moment the store is back;
- its floor: seconds a cold start of the same job from the same checkpoint takes to its
  first completed step (a new RLFineTune resuming from a copy of the location, applied
  the same way, measured in this run);
- steps lost: the last step the old attempt completed minus the step resumed from;
- restarts counted by the operator, rollbacks;
- data exactly once: the finished run's kept history (outputs/metrics.jsonl) trained
  on the same prompts, step by step, as an uninterrupted run of the job (`rlft train`
  here, once).

Faults: a trainer's worker process SIGKILLed mid-step, a trainer container SIGKILLed, a
trainer pod deleted (SIGTERM: emergency checkpoint in its grace, as a preemption or a
drain does), the rollout pod SIGKILLed with requests in flight, the operator SIGKILLed
and restarted, the object store stopped for 30 s.

Goodput: the same job, longer, once undisturbed and once with a fault from that list
every ~2 minutes at random; goodput = seconds of the steps kept (their step_time_s in the
kept history) / wall time from apply to Succeeded. Not measured: the matrix rows the
test cluster cannot run yet (node loss with an elastic resize, OOM, collapse with
alerts, kill during a checkpoint upload, below replicas.min); the JSON line says so.
Last line: JSON with the rows, goodput and `goals_met`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / p) for p in ("cluster", "integration", "")]

from cluster_jobs import NS, finished, rlft  # noqa: E402
from faults import children, data_sequence, faulty_job, kept_history, uninterrupted  # noqa: E402
from seaweedfs import SeaweedServer  # noqa: E402
from testcluster import ProcessCluster, wait_for  # noqa: E402

STEPS, INTERVAL = 40, 2
GOAL_MTTR_OVER_FLOOR = 1.5
GOAL_GOODPUT = 0.8
OUTAGE_S = 30
POD_SLOTS = ("trainer-0", "trainer-1", "rollout-0")
GANG_FAULTS = {"worker SIGKILL", "container SIGKILL", "pod deleted (SIGTERM)"}
"""Faults after which only a restarted gang's step counts (the old gang may still
finish the step it was on: SIGTERM checkpoints it)."""
FAULTS = [
    "worker SIGKILL",
    "container SIGKILL",
    "pod deleted (SIGTERM)",
    "rollout pod SIGKILL",
    "operator SIGKILL",
    f"object store down {OUTAGE_S} s",
]


def job(name: str, bucket: str, steps: int = STEPS) -> dict[str, Any]:
    doc = faulty_job(name, bucket, steps)
    doc["spec"]["checkpoint"]["intervalSteps"] = INTERVAL
    doc["spec"]["restartPolicy"] = {"backoffSeconds": 1, "maxRestarts": 10}
    return doc


def metrics(cluster: ProcessCluster, pod: str) -> list[dict[str, Any]]:
    """Rank 0's metrics.jsonl in `pod`'s current folder (empty if that is not rank 0)."""
    folder = cluster.pod_folder(NS, pod)
    files = list((folder / "volumes").rglob("metrics.jsonl")) if folder else []
    return [r for line in _lines(files[0]) if (r := _row(line))] if files else []


def rank0_steps(cluster: ProcessCluster, name: str) -> list[int]:
    for pod in (f"{name}-trainer-0", f"{name}-trainer-1"):
        rows = metrics(cluster, pod)
        if rows:
            return [int(r["step"]) for r in rows]
    return []


def inject(cluster: ProcessCluster, store: SeaweedServer, fault: str, name: str) -> float:
    """Start `fault`; returns when it is over (time.monotonic()): an outage ends by
    itself, OUTAGE_S later, on a thread, the others at once."""
    pod = f"{name}-trainer-0"
    over = time.monotonic()
    if fault == "worker SIGKILL":
        os.kill(children(cluster.container_pid(NS, pod))[0], signal.SIGKILL)
    elif fault == "container SIGKILL":
        cluster.kill_container(NS, pod)
    elif fault == "pod deleted (SIGTERM)":
        cluster.kubectl("delete", "pod", pod, "-n", NS, "--wait=false")
    elif fault == "rollout pod SIGKILL":
        cluster.kill_container(NS, f"{name}-rollout-0")
    elif fault == "operator SIGKILL":
        cluster.restart_operator()
    elif fault.startswith("object store down"):
        if store.process is None:
            raise ProcessLookupError("the object store is down already")
        store.stop()
        threading.Timer(OUTAGE_S, store.start).start()
        over += OUTAGE_S
    else:
        raise ValueError(fault)
    return over


def first_new_step(
    cluster: ProcessCluster,
    name: str,
    old_uids: set[str],
    old_folders: list[Path | None],
    last_step: int,
    timeout: float,
    restarted: bool,
):
    """(seconds waited, first step, step resumed from, the old attempt's last step) for
    rank 0's first step completed after the fault: in a pod started since, a step past
    the one it resumed from; unless the fault `restarted` the gang, also in a pod of the
    fault's time, a step past `last_step`. The old attempt may finish a step after the
    fault (SIGTERM: it checkpoints it), read while its folders exist."""
    started = time.monotonic()
    at_fault = last_step
    while time.monotonic() - started < timeout:
        for folder in old_folders:
            for file in (folder / "volumes").rglob("metrics.jsonl") if folder else []:
                steps = [int(r["step"]) for x in _lines(file) if (r := _row(x))]
                last_step = max([last_step, *steps])
        for pod in (f"{name}-trainer-0", f"{name}-trainer-1"):
            current = cluster.pod(NS, pod)
            if current is None:
                continue
            rows = metrics(cluster, pod)
            if current["metadata"]["uid"] in old_uids:
                if restarted:
                    continue
                resumed, after = None, at_fault
            else:
                resumed = _resumed_step(cluster.logs(NS, pod))
                after = resumed if resumed is not None else 0
            new = [r for r in rows if int(r["step"]) > after]
            if new:
                return time.monotonic() - started, int(new[0]["step"]), resumed, last_step
        time.sleep(0.1)
    raise TimeoutError(f"{name}: no step after the fault in {timeout:.0f} s")


def _lines(file: Path) -> list[str]:
    try:
        return [line for line in file.read_text().splitlines() if line.strip()]
    except OSError:  # removed with its pod
        return []


def _row(line: str) -> dict[str, Any] | None:
    try:
        return json.loads(line)
    except ValueError:  # a line still being written
        return None


def _resumed_step(log: str) -> int | None:
    marker = "resumed from the checkpoint of step "
    return int(log.rsplit(marker, 1)[1].split()[0]) if marker in log else None


def trainer_uids(cluster: ProcessCluster, name: str) -> set[str]:
    pods = [cluster.pod(NS, f"{name}-trainer-{i}") for i in (0, 1)]
    return {p["metadata"]["uid"] for p in pods if p}


def final_status(cluster: ProcessCluster, name: str, timeout: float = 900) -> dict[str, Any]:
    """The job's status once it is Succeeded or Failed."""
    return wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout, every=1)[
        "status"
    ]


def measure(cluster, store, fault: str, k: int, reference: list[tuple[int, str]]) -> dict:
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
    over = inject(cluster, store, fault, name)
    # An outage's MTTR counts from its end: no step can finish without the store (the
    # rollout pod loads every version from it).
    time.sleep(max(0.0, over - time.monotonic()))
    last_step = max([last_step, *rank0_steps(cluster, name)])
    mttr, first, resumed, last_step = first_new_step(
        cluster, name, before, old_folders, last_step, 600, fault in GANG_FAULTS
    )
    status = final_status(cluster, name)
    kept = data_sequence(kept_history(store.client(), bucket, name))
    start = resumed if resumed is not None else resumable_step(store, bucket, name)
    floor = cold_start(cluster, store, bucket, name, start, k)
    return {
        "fault": fault,
        "mttr_s": round(mttr, 1),
        "floor_s": round(floor, 1),
        "mttr_over_floor": round(mttr / floor, 2),
        "steps_lost": last_step - resumed if resumed is not None else 0,
        "resumed_from": resumed,
        "first_step_after": first,
        "restarts": status.get("restarts", 0),
        "rollbacks": status.get("rollbacks", 0),
        "data_exactly_once": kept == reference[:STEPS],
        "phase": status["phase"],
    }


def resumable_step(store: SeaweedServer, bucket: str, name: str) -> int:
    """The newest committed checkpoint with steps after it (a job that did not restart
    has nothing to resume from; its floor is a cold start from one of its checkpoints)."""
    listing = store.client().list_objects_v2(Bucket=bucket, Prefix=f"{name}/step-")
    keys = [item["Key"] for item in listing.get("Contents", [])]
    steps = {
        int(k.split("/")[1].removeprefix("step-")) for k in keys if k.endswith("manifest.json")
    }
    return max(step for step in steps if step < STEPS)


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
    wait_for(
        lambda: [s for s in rank0_steps(cluster, cold) if s > step],
        f"{cold}: its first step",
        600,
        every=0.1,
    )
    seconds = time.monotonic() - started
    remove(cluster, cold)
    return seconds


def remove(cluster: ProcessCluster, name: str) -> None:
    cluster.kubectl("delete", "rlft", name, "-n", NS, "--wait=false")
    wait_for(
        lambda: (
            not any(cluster.pod(NS, f"{name}-{p}") for p in ("trainer-0", "trainer-1", "rollout-0"))
        ),
        f"{name}'s pods to go",
        120,
    )


def goodput(cluster, store, steps: int, every_s: float, faulty: bool, seed: int) -> dict:
    """One run of the job for `steps`; with `faulty`, a random fault of FAULTS every
    ~`every_s` seconds (uniform in [0.75, 1.25]×) until it finishes."""
    name = f"goodput-{'faulty' if faulty else 'calm'}"
    store.create_bucket(name)
    started = time.monotonic()
    cluster.apply(job(name, name, steps))
    injected: list[str] = []
    chooser = random.Random(seed)
    next_at = started + every_s * chooser.uniform(0.75, 1.25)
    while True:
        status = (rlft(cluster, name) or {}).get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            break
        now = time.monotonic()
        if faulty and now >= next_at and status.get("phase") == "Running":
            fault = chooser.choice(FAULTS)
            try:
                inject(cluster, store, fault, name)
                injected.append(fault)
            except (AssertionError, IndexError, ProcessLookupError) as error:
                print(f"  ({fault} not injected: {error})", flush=True)
            next_at = now + every_s * chooser.uniform(0.75, 1.25)
        if now - started > 3600:
            raise TimeoutError(f"{name} did not finish in an hour")
        time.sleep(1)
    wall = time.monotonic() - started
    wait_for(lambda: store.process is not None, "the store back up", OUTAGE_S + 30)
    history = kept_history(store.client(), name, name)
    kept_s = sum(float(r["step_time_s"]) for r in history)
    remove(cluster, name)
    return {
        "run": "faulty" if faulty else "undisturbed",
        "steps": steps,
        "wall_s": round(wall, 1),
        "kept_step_s": round(kept_s, 1),
        "goodput": round(kept_s / wall, 3),
        "faults": injected,
        "restarts": status.get("restarts", 0),
        "phase": status["phase"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", nargs="*", default=FAULTS, help="rows to measure")
    parser.add_argument("--goodput-steps", type=int, default=240)
    parser.add_argument("--fault-every", type=float, default=120.0, help="seconds")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rlft-recovery-"))
    reference = uninterrupted(job("reference", "none"), workdir / "reference", STEPS)
    store = SeaweedServer(workdir / "seaweedfs", workdir / "seaweedfs.log")
    store.start()
    rows, runs = [], []
    try:
        with ProcessCluster(workdir / "cluster", nodes=2) as cluster:
            cluster.install_operator(NS, store.credentials(), secret="s3-creds")
            print(
                f"{'fault':26} {'MTTR s':>7} {'floor s':>8} {'ratio':>6} {'lost':>5} "
                f"{'restarts':>8} {'rollbacks':>9} {'data once':>9}  phase"
            )
            for k, fault in enumerate(args.faults):
                row = measure(cluster, store, fault, k, reference)
                rows.append(row)
                print(
                    f"{fault:26} {row['mttr_s']:7.1f} {row['floor_s']:8.1f} "
                    f"{row['mttr_over_floor']:6.2f} {row['steps_lost']:5d} {row['restarts']:8d} "
                    f"{row['rollbacks']:9d} {row['data_exactly_once']!s:>9}  {row['phase']}",
                    flush=True,
                )
            if args.goodput_steps:
                for faulty in (False, True):
                    run = goodput(
                        cluster, store, args.goodput_steps, args.fault_every, faulty, args.seed
                    )
                    runs.append(run)
                    print(
                        f"goodput {run['run']:11} {run['goodput']:.3f} = {run['kept_step_s']} s "
                        f"of kept steps / {run['wall_s']} s wall; faults {run['faults']}, "
                        f"restarts {run['restarts']}, {run['phase']}",
                        flush=True,
                    )
    finally:
        store.stop()
    faulty = next((r for r in runs if r["run"] == "faulty"), None)
    goals = {
        "mttr_within_1.5x_floor": all(r["mttr_over_floor"] <= GOAL_MTTR_OVER_FLOOR for r in rows),
        "steps_lost_within_interval": all(r["steps_lost"] <= INTERVAL for r in rows),
        "data_exactly_once": all(r["data_exactly_once"] for r in rows),
        "all_succeeded": all(r["phase"] == "Succeeded" for r in rows + runs),
        f"goodput_at_least_{GOAL_GOODPUT}": faulty is not None
        and faulty["goodput"] >= GOAL_GOODPUT,
    }
    print(
        json.dumps(
            {
                "rows": rows,
                "goodput": runs,
                "checkpoint_interval": INTERVAL,
                "goals": goals,
                "goals_met": all(goals.values()),
                "not_measured": [
                    "node loss with elastic resize",
                    "OOM kill",
                    "collapse with alerts",
                    "kill during a checkpoint upload",
                    "below replicas.min",
                ],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
