"""The faults `bench/recovery.py` injects: for each, what the job needs to meet it (a
memory limit, a store behind a proxy, one trainer pod per node, planted gradients) and
how it is injected into the running processes. Each `inject` returns when the fault is
over (time.monotonic()), the moment its MTTR counts from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_jobs import ALGORITHMS, NS, one_trainer_per_node
from faults import start_oom, worker_of
from node_lifecycle import NODE_GRACE_S
from s3_proxy import S3Proxy
from seaweedfs import SeaweedServer
from testcluster import ProcessCluster, wait_for

OUTAGE_S = 30
"""How long the object store is down."""
CAPACITY_GONE_S = 20
"""How long the gang has fewer nodes than replicas.min."""
NODE_LOST_S = 5
"""spec.scheduling.nodeLostSeconds of the node-loss job."""
PROXIED_SECRET = "s3-proxied"
NAN_AT = 8
"""The NaN row's planted non-finite gradient (skipped by the guard)."""
BLOW_UP = (22, 28)
"""The blow-up row's planted gradient ×100, steps 22–27 (rolled back; the detector
judges grad norms from step 20)."""


@dataclass
class Context:
    cluster: ProcessCluster
    store: SeaweedServer
    proxy: S3Proxy
    name: str
    bucket: str
    background: list[Any] = field(default_factory=list)
    """What an injection leaves running (an allocator, a timer), waited for by `settle`."""

    def trainer(self, i: int = 0) -> str:
        return f"{self.name}-trainer-{i}"

    def settle(self) -> None:
        for item in self.background:
            if isinstance(item, subprocess.Popen):
                item.communicate(timeout=120)
            else:
                item.join(timeout=OUTAGE_S + 30)
        self.background.clear()


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[Context], float]
    gang: bool = False
    """A gang fault: only a restarted gang's step ends it (the old gang may still
    finish the step it was on: SIGTERM checkpoints it)."""
    prepare: Callable[[dict[str, Any]], None] = lambda job: None
    """What the job needs to meet the fault (applied to its cold start too)."""
    declare_s: float = 0.0
    """Grace before the platform declares the fault (a lost node), added to the floor."""
    rollback: bool = False
    """Met in process by a rollback: steps lost count from the planted blow-up."""


def _kill_worker(ctx: Context) -> float:
    os.kill(worker_of(ctx.cluster, ctx.trainer()), signal.SIGKILL)
    return time.monotonic()


def _kill_container(ctx: Context) -> float:
    ctx.cluster.kill_container(NS, ctx.trainer())
    return time.monotonic()


def _delete_pod(ctx: Context) -> float:
    ctx.cluster.kubectl("delete", "pod", ctx.trainer(), "-n", NS, "--wait=false")
    return time.monotonic()


def _kill_rollout(ctx: Context) -> float:
    ctx.cluster.kill_container(NS, f"{ctx.name}-rollout-0")
    return time.monotonic()


def _kill_operator(ctx: Context) -> float:
    ctx.cluster.restart_operator()
    return time.monotonic()


def _store_down(ctx: Context) -> float:
    """An outage's MTTR counts from its end: no step can finish without the store (the
    rollout pod loads every version from it)."""
    store = ctx.store
    if store.process is None:
        raise ProcessLookupError("the object store is down already")
    store.stop()
    timer = threading.Timer(OUTAGE_S, store.start)
    timer.start()
    ctx.background.append(timer)
    return time.monotonic() + OUTAGE_S


def _with_memory_limit(job: dict[str, Any]) -> None:
    job["spec"]["trainer"]["resources"]["limits"] = {"memory": "3Gi"}


def _oom(ctx: Context) -> float:
    """The fault is the kernel's kill of the worker: the allocation and the reclaim the
    kernel tries first (seconds, paging the container's mapped libraries) lead up to
    it, as a leak's growth does."""
    worker = worker_of(ctx.cluster, ctx.trainer())
    ctx.background.append(start_oom(ctx.cluster, ctx.trainer()))
    wait_for(lambda: not _running(worker), "the OOM kill", 120, every=0.02)
    return time.monotonic()


def _running(pid: int) -> bool:
    """Alive and not a zombie (killed, not yet reaped by its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _through_proxy(job: dict[str, Any]) -> None:
    job["spec"]["checkpoint"]["credentialsSecret"] = PROXIED_SECRET


def _kill_in_upload(ctx: Context) -> float:
    """trainer-0 SIGKILLed while the next checkpoint's uploads are held in flight."""
    ctx.proxy.hold(f"/{ctx.bucket}/{ctx.name}/step-")
    wait_for(lambda: ctx.proxy.held, "a checkpoint upload in flight", 120, every=0.05)
    ctx.cluster.kill_container(NS, ctx.trainer())
    at = time.monotonic()
    ctx.proxy.release()
    return at


def _one_pod_per_node(job: dict[str, Any]) -> None:
    one_trainer_per_node(job)
    # The default schedulingTimeoutSeconds: it is also the rendezvous' join timeout, and
    # pods of a gang that start seconds apart on a busy machine must still meet.
    job["spec"]["scheduling"] = {"nodeLostSeconds": NODE_LOST_S}


def _capacity_gone(ctx: Context) -> float:
    """Every node but trainer-0's tainted NoSchedule and trainer-1 deleted (a drain): the
    restarted gang cannot place trainer-1 and waits; CAPACITY_GONE_S later the taints
    go. MTTR counts from then."""
    cluster = ctx.cluster
    keep = cluster.pod(NS, ctx.trainer(0))["spec"]["nodeName"]
    tainted = [node.name for node in cluster.nodes if node.name != keep]
    for node in tainted:
        cluster.kubectl("taint", "nodes", node, "rlft.dev/bench=full:NoSchedule")
    cluster.kubectl("delete", "pod", ctx.trainer(1), "-n", NS, "--wait=false")
    time.sleep(CAPACITY_GONE_S)
    for node in tainted:
        cluster.kubectl("taint", "nodes", node, "rlft.dev/bench=full:NoSchedule-")
    return time.monotonic()


def _elastic(job: dict[str, Any]) -> None:
    _one_pod_per_node(job)
    job["spec"]["trainer"]["replicas"] = {"min": 2, "max": 3}


def _lose_node(ctx: Context) -> float:
    """trainer-2's node lost: its kubelet and containers die, its heartbeats stop."""
    node = ctx.cluster.pod(NS, ctx.trainer(2))["spec"]["nodeName"]
    ctx.cluster.node(node).lose()
    ctx.background.append(_Rejoin(ctx, node))
    return time.monotonic()


class _Rejoin:
    """Brings a lost node back once `settle` is called (after the row's MTTR) and
    measures the growth back to world size 3: seconds from the rejoin to a step of
    the regrown gang."""

    def __init__(self, ctx: Context, node: str):
        self.ctx, self.node = ctx, node
        self.regrow_s: float | None = None

    def join(self, timeout: float) -> None:
        cluster, ctx = self.ctx.cluster, self.ctx
        grown = _world_3_starts(cluster, ctx.name)
        cluster.node(self.node).rejoin()
        started = time.monotonic()
        wait_for(lambda: _world_3_starts(cluster, ctx.name) > grown, "world size 3", 300, 0.2)
        self.regrow_s = time.monotonic() - started


def _world_3_starts(cluster: ProcessCluster, name: str) -> int:
    logs = "".join(cluster.logs(NS, f"{name}-trainer-{i}") for i in range(3))
    return logs.count("rank 0 of world size 3")


def _planting(*faults: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """DPO with `faults` planted through the pods' env. DPO: the tiny GRPO job's rewards
    are all 0, so are its gradients, and scaling them blows nothing up."""

    def prepare(job: dict[str, Any]) -> None:
        job["spec"]["algorithm"] |= ALGORITHMS["dpo"]
        env = [{"name": "RLFT_PLANT_FAULTS", "value": json.dumps(list(faults))}]
        job["spec"]["trainer"]["env"] = env

    return prepare


def _guard_acted(action: str) -> Callable[[Context], float]:
    """Waits for the guard's `action` (in rank 0's record of the step it judged); the
    fault is that moment (it is planted: there is nothing to inject)."""

    def seen(ctx: Context) -> float:
        def acted() -> bool:
            records = rank0_records(ctx.cluster, ctx.name)
            return any(r.get("guard_action") == action for r in records)

        wait_for(acted, f"the guard's {action}", 300, every=0.05)
        return time.monotonic()

    return seen


TRAINERS = range(3)
"""Trainer pod ordinals a job of the bench may have (rank 0 may be any of them)."""


def records(cluster: ProcessCluster, pod: str) -> list[dict[str, Any]]:
    """Rank 0's metrics.jsonl in `pod`'s current folder (empty if that is not rank 0)."""
    folder = cluster.pod_folder(NS, pod)
    files = list((folder / "volumes").rglob("metrics.jsonl")) if folder else []
    return file_records(files[0]) if files else []


def rank0_records(cluster: ProcessCluster, name: str) -> list[dict[str, Any]]:
    for i in TRAINERS:
        found = records(cluster, f"{name}-trainer-{i}")
        if found:
            return found
    return []


def file_records(file: Path) -> list[dict[str, Any]]:
    try:
        lines = [line for line in file.read_text().splitlines() if line.strip()]
    except OSError:  # removed with its pod
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:  # a line still being written
            continue
    return found


FAULTS = {
    fault.name: fault
    for fault in [
        Fault("worker SIGKILL", _kill_worker, gang=True),
        Fault("container SIGKILL", _kill_container, gang=True),
        Fault("pod deleted (SIGTERM)", _delete_pod, gang=True),
        Fault("rollout pod SIGKILL", _kill_rollout),
        Fault("operator SIGKILL", _kill_operator),
        Fault(f"object store down {OUTAGE_S} s", _store_down),
        Fault("OOM kill", _oom, gang=True, prepare=_with_memory_limit),
        Fault("kill in ckpt upload", _kill_in_upload, gang=True, prepare=_through_proxy),
        Fault(
            f"below min {CAPACITY_GONE_S} s", _capacity_gone, gang=True, prepare=_one_pod_per_node
        ),
        Fault(
            "node lost (3 -> 2)",
            _lose_node,
            gang=True,
            prepare=_elastic,
            declare_s=NODE_GRACE_S + NODE_LOST_S,
        ),
        Fault(
            "NaN gradient",
            _guard_acted("skip"),
            prepare=_planting(
                {"kind": "grad_scale", "from": NAN_AT, "to": NAN_AT + 1, "factor": float("nan")}
            ),
        ),
        Fault(
            "gradient blow-up",
            _guard_acted("rollback"),
            prepare=_planting(
                {"kind": "grad_scale", "from": BLOW_UP[0], "to": BLOW_UP[1], "factor": 100}
            ),
            rollback=True,
        ),
    ]
}
GOODPUT_FAULTS = [
    "worker SIGKILL",
    "container SIGKILL",
    "pod deleted (SIGTERM)",
    "rollout pod SIGKILL",
    "operator SIGKILL",
    f"object store down {OUTAGE_S} s",
    "OOM kill",
]
"""The faults that can hit one running job of one shape at any moment (the goodput job
has the memory limit the OOM kill needs); the others need a job of their own shape."""
