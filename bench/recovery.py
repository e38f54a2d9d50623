"""Recovery from faults on the test cluster, measured: one row per fault, then goodput.

The test cluster of `tests/cluster/` (emulated API server, three process kubelets whose
pods are real processes, SeaweedFS, the real operator) runs the tiny GRPO job on 2
trainer pods with a checkpoint every 2 steps, shaped as each fault needs
(`_recovery_faults.py`). For each fault the bench waits for a committed checkpoint and a
few more steps, injects the fault into the running processes and measures:

- MTTR: seconds from the fault to the next step completed after it (a new line in rank
  0's metrics.jsonl: of a restarted gang, a step past the one it resumed from); for a
  fault that lasts (the object store down, capacity below replicas.min), from its end;
  for a collapse, from the guard's rollback;
- its floor: seconds a cold start of the same job from the same checkpoint takes to its
  first completed step (a new RLFineTune resuming from a copy of the location, applied
  the same way, measured in this run); for the node loss, plus the grace that declares
  the node lost (the node lifecycle's 10 s, then the pods' nodeLostSeconds);
- steps lost: the last step the old attempt completed minus the step resumed from (for
  a rollback: the healthy steps before the planted blow-up that it undid);
- restarts counted by the operator, rollbacks;
- data exactly once: the finished run's kept history (outputs/metrics.jsonl) trained
  on the same prompts, step by step, as an uninterrupted run of the job (`rlft train`
  here, once per algorithm).

Faults: a trainer's worker SIGKILLed mid-step, a trainer container SIGKILLed, a trainer
pod deleted (SIGTERM: emergency checkpoint in its grace, as a preemption or a drain
does), the rollout pod SIGKILLed with requests in flight, the operator SIGKILLed and
restarted, the object store stopped for 30 s, an OOM kill through the container's real
memory cgroup, a trainer SIGKILLed while its checkpoint upload is held in flight, the
gang below replicas.min for 20 s, a node lost under replicas {min: 2, max: 3} (and the
time to grow back once it rejoins), a planted NaN gradient, a planted gradient blow-up
(DPO: the tiny GRPO job's gradients are zero).

Goodput: the same job, longer, once undisturbed and once with a fault every ~2 minutes
at random from those one running job of one shape can meet at any moment (the first
seven); goodput = seconds of the steps kept (their step_time_s in the kept history) /
wall time from apply to Succeeded. Last line: JSON with the rows, goodput and
`goals_met`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / p) for p in ("cluster", "integration", "")]

from _recovery_faults import (  # noqa: E402
    BLOW_UP,
    FAULTS,
    GOODPUT_FAULTS,
    PROXIED_SECRET,
    TRAINERS,
    Context,
    Fault,
    file_records,
    rank0_records,
    records,
)
from cluster_jobs import NS, finished, rlft  # noqa: E402
from faults import data_sequence, faulty_job, kept_history, uninterrupted  # noqa: E402
from s3_proxy import S3Proxy  # noqa: E402
from seaweedfs import SeaweedServer  # noqa: E402
from testcluster import ProcessCluster, wait_for  # noqa: E402

STEPS, INTERVAL = 40, 2
ELASTIC_STEPS = 100
"""The node-loss job runs longer: it shrinks, then grows back."""
GOAL_MTTR_OVER_FLOOR = 1.5
GOAL_GOODPUT = 0.8
NO_FAULT = Fault("none", lambda ctx: time.monotonic())


def job(name: str, bucket: str, steps: int = STEPS, fault: Fault = NO_FAULT) -> dict[str, Any]:
    doc = faulty_job(name, bucket, steps)
    doc["spec"]["checkpoint"]["intervalSteps"] = INTERVAL
    doc["spec"]["restartPolicy"] = {"backoffSeconds": 1, "maxRestarts": 10}
    fault.prepare(doc)
    return doc


def fault_job(name: str, bucket: str, fault: Fault) -> dict[str, Any]:
    steps = ELASTIC_STEPS if fault.name.startswith("node lost") else STEPS
    return job(name, bucket, steps, fault)


def rank0_steps(cluster: ProcessCluster, name: str) -> list[int]:
    return [int(r["step"]) for r in rank0_records(cluster, name)]


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
                last_step = max([last_step, *(int(r["step"]) for r in file_records(file))])
        for i in TRAINERS:
            pod = f"{name}-trainer-{i}"
            current = cluster.pod(NS, pod)
            if current is None:
                continue
            rows = records(cluster, pod)
            if current["metadata"]["uid"] in old_uids:
                if restarted:
                    continue
                resumed, after = None, at_fault
            else:
                resumed = _step_after(cluster.logs(NS, pod), "resumed from the checkpoint of step ")
                after = resumed if resumed is not None else 0
            new = [r for r in rows if int(r["step"]) > after]
            if new:
                return time.monotonic() - started, int(new[0]["step"]), resumed, last_step
        time.sleep(0.1)
    raise TimeoutError(f"{name}: no step after the fault in {timeout:.0f} s")


def _step_after(log: str, marker: str) -> int | None:
    return int(log.rsplit(marker, 1)[1].split()[0].rstrip(";:,")) if marker in log else None


def trainer_uids(cluster: ProcessCluster, name: str) -> set[str]:
    pods = [cluster.pod(NS, f"{name}-trainer-{i}") for i in TRAINERS]
    return {p["metadata"]["uid"] for p in pods if p}


def trainer_logs(cluster: ProcessCluster, name: str) -> str:
    return "".join(cluster.logs(NS, f"{name}-trainer-{i}") for i in TRAINERS)


def final_status(cluster: ProcessCluster, name: str, timeout: float = 900) -> dict[str, Any]:
    """The job's status once it is Succeeded or Failed."""
    return wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout, every=1)[
        "status"
    ]


class References:
    """The uninterrupted run of each algorithm's job (`rlft train` here, once each)."""

    def __init__(self, folder: Path):
        self.folder, self.runs = folder, {}

    def __call__(self, doc: dict[str, Any]) -> list[tuple[int, str]]:
        algorithm = doc["spec"]["algorithm"]
        if algorithm["name"] not in self.runs:
            base = job("reference", "none")
            base["spec"]["algorithm"] = algorithm
            folder = self.folder / algorithm["name"]
            self.runs[algorithm["name"]] = uninterrupted(base, folder, ELASTIC_STEPS)
        return self.runs[algorithm["name"]]


def measure(ctx: Context, fault: Fault, k: int, references: References) -> dict:
    cluster, store, name, bucket = ctx.cluster, ctx.store, ctx.name, ctx.bucket
    store.create_bucket(bucket)
    doc = fault_job(name, bucket, fault)
    steps = doc["spec"]["trainer"]["steps"]
    cluster.apply(doc)
    wait_for(
        lambda: len(rank0_steps(cluster, name)) >= 2 * INTERVAL + 1,
        f"{name}: a checkpoint and more steps",
        timeout=600,
        every=0.2,
    )
    before = trainer_uids(cluster, name)
    old_folders = [cluster.pod_folder(NS, f"{name}-trainer-{i}") for i in TRAINERS]
    last_step = max(rank0_steps(cluster, name))
    over = fault.inject(ctx)
    time.sleep(max(0.0, over - time.monotonic()))
    last_step = max([last_step, *rank0_steps(cluster, name)])
    mttr, first, resumed, last_step = first_new_step(
        cluster, name, before, old_folders, last_step, 600, fault.gang
    )
    pending = list(ctx.background)
    ctx.settle()
    regrow = [getattr(item, "regrow_s", None) for item in pending]
    status = final_status(cluster, name)
    kept = data_sequence(kept_history(store.client(), bucket, name))
    # The old attempt's last step may be one its folders lost before they were read (a
    # stopped gang checkpoints the step it was on): resuming past it loses nothing.
    lost = max(0, last_step - resumed) if resumed is not None else 0
    if fault.rollback:
        marker = "rolled back to the healthy checkpoint of step "
        resumed = _step_after(trainer_logs(cluster, name), marker)
        lost = max(0, BLOW_UP[0] - 1 - resumed) if resumed is not None else 0
    start = resumed if resumed is not None else resumable_step(store, bucket, name, steps)
    floor = cold_start(ctx, fault, start, k) + fault.declare_s
    row = {
        "fault": fault.name,
        "mttr_s": round(mttr, 1),
        "floor_s": round(floor, 1),
        "mttr_over_floor": round(mttr / floor, 2),
        "steps_lost": lost,
        "resumed_from": resumed,
        "first_step_after": first,
        "restarts": status.get("restarts", 0),
        "rollbacks": status.get("rollbacks", 0),
        "data_exactly_once": kept == references(doc)[:steps],
        "phase": status["phase"],
    }
    if fault.declare_s:
        row["declare_s"] = fault.declare_s
    if regrow and regrow[0] is not None:
        row["regrow_s"] = round(regrow[0], 1)
    return row


def resumable_step(store: SeaweedServer, bucket: str, name: str, steps: int) -> int:
    """The newest committed checkpoint with steps after it (a job that did not restart
    has nothing to resume from; its floor is a cold start from one of its checkpoints)."""
    listing = store.client().list_objects_v2(Bucket=bucket, Prefix=f"{name}/step-")
    keys = [item["Key"] for item in listing.get("Contents", [])]
    saved = {
        int(k.split("/")[1].removeprefix("step-")) for k in keys if k.endswith("manifest.json")
    }
    return max(step for step in saved if step < steps)


def cold_start(ctx: Context, fault: Fault, step: int, k: int) -> float:
    """A new job of the fault's shape resuming from a copy of the faulty job's checkpoint
    of `step`: time from apply to its first completed step (the same pods, images and
    resume a restart goes through)."""
    cluster, bucket, client = ctx.cluster, ctx.bucket, ctx.store.client()
    source, target = f"{ctx.name}/step-{step:06d}/", f"cold-{k}/step-{step:06d}/"
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
    cluster.apply(fault_job(cold, bucket, fault))
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
    slots = [f"trainer-{i}" for i in TRAINERS] + ["rollout-0"]
    wait_for(
        lambda: not any(cluster.pod(NS, f"{name}-{slot}") for slot in slots),
        f"{name}'s pods to go",
        120,
    )


def goodput(
    ctx: Context, steps: int, interval: int, every_s: float, faulty: bool, seed: int
) -> dict:
    """One run of the job for `steps`, a checkpoint every `interval`; with `faulty`, a
    random fault of GOODPUT_FAULTS every ~`every_s` seconds (uniform in [0.75, 1.25]×)
    until it finishes. Where the rest of the wall time went: before the first step
    (pods, warm start, evaluation), after the last (final checkpoint, outputs, Succeeded
    seen), and between (checkpoints, faults and recoveries, the loop's own work)."""
    cluster, store, name = ctx.cluster, ctx.store, ctx.name
    store.create_bucket(name)
    doc = job(name, name, steps, FAULTS["OOM kill"])  # the memory limit the OOM needs
    doc["spec"]["checkpoint"]["intervalSteps"] = interval
    started = time.monotonic()
    cluster.apply(doc)
    injected: list[str] = []
    chooser = random.Random(seed)
    next_at = started + every_s * chooser.uniform(0.75, 1.25)
    first_step_at = last_step_at = None
    seen = 0
    while True:
        status = (rlft(cluster, name) or {}).get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            break
        now = time.monotonic()
        done = len(rank0_steps(cluster, name))
        if done != seen:  # a step completed (or a resumed rank 0's history rewritten)
            first_step_at, last_step_at, seen = first_step_at or now, now, done
        if faulty and now >= next_at and status.get("phase") == "Running":
            fault = chooser.choice(GOODPUT_FAULTS)
            try:
                FAULTS[fault].inject(ctx)
                injected.append(fault)
            except (AssertionError, IndexError, ProcessLookupError, OSError) as error:
                print(f"  ({fault} not injected: {error})", flush=True)
            next_at = now + every_s * chooser.uniform(0.75, 1.25)
        if now - started > 3600:
            raise TimeoutError(f"{name} did not finish in an hour")
        time.sleep(0.2)
    wall = time.monotonic() - started
    ctx.settle()
    history = kept_history(store.client(), name, name)
    kept_s = sum(float(r["step_time_s"]) for r in history)
    remove(cluster, name)
    return {
        "run": "faulty" if faulty else "undisturbed",
        "steps": steps,
        "wall_s": round(wall, 1),
        "kept_step_s": round(kept_s, 1),
        "goodput": round(kept_s / wall, 3),
        "checkpoint_interval": interval,
        "to_first_step_s": round((first_step_at or started) - started, 1),
        "after_last_step_s": round(started + wall - (last_step_at or started), 1),
        "faults": injected,
        "restarts": status.get("restarts", 0),
        "phase": status["phase"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), help="rows to measure")
    parser.add_argument("--goodput-steps", type=int, default=600)
    parser.add_argument("--goodput-interval", type=int, default=10, help="checkpoint steps")
    parser.add_argument("--fault-every", type=float, default=120.0, help="seconds")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rlft-recovery-"))
    references = References(workdir / "reference")
    store = SeaweedServer(workdir / "seaweedfs", workdir / "seaweedfs.log")
    store.start()
    proxy = S3Proxy(store.endpoint)
    rows, runs = [], []
    try:
        with ProcessCluster(workdir / "cluster", nodes=3) as cluster:
            cluster.install_operator(NS, store.credentials(), secret="s3-creds")
            proxied = store.credentials() | {"AWS_ENDPOINT_URL": proxy.url}
            cluster.create_secret(NS, PROXIED_SECRET, proxied)
            print(
                f"{'fault':26} {'MTTR s':>7} {'floor s':>8} {'ratio':>6} {'lost':>5} "
                f"{'restarts':>8} {'rollbacks':>9} {'data once':>9}  phase"
            )
            for k, fault in enumerate(args.faults):
                ctx = Context(cluster, store, proxy, f"fault-{k}", f"recovery-{k}")
                row = measure(ctx, FAULTS[fault], k, references)
                rows.append(row)
                extra = "".join(
                    f"; {key} {row[key]}" for key in ("declare_s", "regrow_s") if key in row
                )
                print(
                    f"{fault:26} {row['mttr_s']:7.1f} {row['floor_s']:8.1f} "
                    f"{row['mttr_over_floor']:6.2f} {row['steps_lost']:5d} {row['restarts']:8d} "
                    f"{row['rollbacks']:9d} {row['data_exactly_once']!s:>9}  {row['phase']}{extra}",
                    flush=True,
                )
            for faulty in (False, True) if args.goodput_steps else ():
                name = f"goodput-{'faulty' if faulty else 'calm'}"
                ctx = Context(cluster, store, proxy, name, name)
                run = goodput(
                    ctx,
                    args.goodput_steps,
                    args.goodput_interval,
                    args.fault_every,
                    faulty,
                    args.seed,
                )
                runs.append(run)
                print(
                    f"goodput {run['run']:11} {run['goodput']:.3f} = {run['kept_step_s']} s "
                    f"of kept steps / {run['wall_s']} s wall ({run['to_first_step_s']} s "
                    f"before the first step, {run['after_last_step_s']} s after the last); "
                    f"faults {run['faults']}, restarts {run['restarts']}, {run['phase']}",
                    flush=True,
                )
    finally:
        proxy.stop()
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
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
