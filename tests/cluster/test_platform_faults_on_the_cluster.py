"""Faults of what runs around the trainer, injected into running jobs on the test cluster:
the operator killed mid-reconcile, the object store down for 30 s, the rollout pod
killed with requests in flight. Each job reaches Succeeded with its trainer gang intact
and every step's data trained once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_jobs import NS, finished, one_trainer_per_node
from faults import (
    assert_data_exactly_once,
    checkpointed,
    events,
    faulty_job,
    job_status,
    kept_history,
)
from seaweedfs import SeaweedServer
from testcluster import ProcessCluster, wait_for

RLFT = [sys.executable, "-m", "rlft.trainer.cli.main"]


class PodWatch:
    """Every uid each of a job's pod names had, polled from the API server while the
    test runs (a duplicate or a needless replacement shows as a second uid)."""

    def __init__(self, cluster: ProcessCluster, job: str):
        self.cluster, self.job = cluster, job
        self.uids: dict[str, set[str]] = {}
        self.most_at_once = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            pods = [
                p
                for p in self.cluster.api.list("pods", NS)
                if (p["metadata"].get("labels") or {}).get("rlft.dev/job") == self.job
            ]
            self.most_at_once = max(self.most_at_once, len(pods))
            for pod in pods:
                self.uids.setdefault(pod["metadata"]["name"], set()).add(pod["metadata"]["uid"])
            time.sleep(0.1)

    def stop(self) -> dict[str, set[str]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.uids


def test_the_operator_killed_mid_reconcile_and_restarted_converges_without_duplicates(
    cluster, seaweed, reference
):
    """SIGKILL of the operator while it creates the job's children, and again while the
    job trains: each new operator carries on from the custom resource's status and what
    exists; no pod is created twice, none replaced, nothing counted as a failure."""
    bucket, name = "faults-operator", "operator-kill"
    seaweed.create_bucket(bucket)
    watch = PodWatch(cluster, name)
    cluster.apply(faulty_job(name, bucket, steps=12))
    wait_for(lambda: watch.uids, "the first of the job's pods", timeout=60, every=0.02)
    cluster.restart_operator()  # mid-create: some children made, the status not yet
    wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, every=0.5)
    cluster.restart_operator()  # mid-run: polling /status, mirroring it
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    uids = watch.stop()
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status.get("restarts", 0) == 0 and not status.get("lastFailure"), status
    expected = {f"{name}-trainer-0", f"{name}-trainer-1", f"{name}-rollout-0"}
    assert set(uids) == expected, uids
    assert all(len(seen) == 1 for seen in uids.values()), uids  # none created twice
    assert watch.most_at_once == len(expected)
    assert sum(e["reason"] == "Succeeded" for e in events(cluster, name)) == 1
    client = seaweed.client()
    assert_data_exactly_once(kept_history(client, bucket, name), reference, 12)


@pytest.fixture
def outage_store(cluster, tmp_path) -> Iterator[SeaweedServer]:
    """A SeaweedFS of the test's own (the session's stays up for the other tests), with
    its credentials in the Secret `s3-outage`."""
    store = SeaweedServer(tmp_path / "seaweedfs", tmp_path / "weed.log")
    store.start()
    cluster.create_secret(NS, "s3-outage", store.credentials())
    try:
        yield store
    finally:
        store.stop()


def test_the_object_store_down_for_30_s_is_waited_out(cluster, outage_store, reference):
    """SeaweedFS stopped for 30 s mid-run, then started again on the same data: checkpoint
    uploads and weight publication retry through the outage; the job completes with
    every committed checkpoint intact (`rlft checkpoints verify`) and no restart."""
    bucket, name = "faults-store", "store-outage"
    outage_store.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=16)
    job["spec"]["checkpoint"]["credentialsSecret"] = "s3-outage"
    cluster.apply(job)
    saved = wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, 0.5)
    outage_store.stop()
    time.sleep(30)
    outage_store.start()
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    logs = cluster.logs(NS, f"{name}-trainer-0") + cluster.logs(NS, f"{name}-trainer-1")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1) + logs[-4000:]
    assert status.get("restarts", 0) == 0, json.dumps(status, indent=1) + logs[-4000:]
    assert "retrying" in logs, logs[-4000:]
    assert saved < 16
    verified = subprocess.run(
        [
            *RLFT,
            "checkpoints",
            "verify",
            f"s3://{bucket}/{name}",
            "--endpoint-url",
            outage_store.endpoint,
            "--addressing-style",
            "path",
        ],
        env=dict(os.environ, **outage_store.credentials()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = verified.stdout.splitlines()
    assert verified.returncode == 0 and lines, verified.stdout + verified.stderr
    assert all(line.endswith(": ok") for line in lines), verified.stdout
    assert lines[-1] == "step-000016: ok", verified.stdout  # the last step's, committed
    client = outage_store.client()
    assert_data_exactly_once(kept_history(client, bucket, name), reference, 16)


def test_the_rollout_pod_killed_with_requests_in_flight_is_replaced(cluster, seaweed, reference):
    """SIGKILL of the rollout server while the trainer's generate requests are in flight:
    the operator replaces that pod alone, the trainer's client retries until the new
    instance (caught up to the newest weights) answers; the trainer gang is untouched."""
    bucket, name = "faults-rollout", "rollout-kill"
    seaweed.create_bucket(bucket)
    watch = PodWatch(cluster, name)
    cluster.apply(faulty_job(name, bucket, steps=16))
    wait_for(lambda: (job_status(cluster, name).get("step") or 0) >= 3, "3 steps", 300, every=0.5)
    cluster.kill_container(NS, f"{name}-rollout-0")
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    uids = watch.stop()
    status = done["status"]
    logs = cluster.logs(NS, f"{name}-trainer-0") + cluster.logs(NS, f"{name}-trainer-1")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1) + logs[-4000:]
    assert status["restarts"] == 1 and status["lastFailure"]["pod"] == f"{name}-rollout-0"
    assert len(uids[f"{name}-rollout-0"]) == 2, uids  # replaced once
    assert all(len(uids[f"{name}-trainer-{i}"]) == 1 for i in (0, 1)), uids  # gang untouched
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 16)


def test_a_gang_below_replicas_min_waits_says_so_and_resumes_when_capacity_returns(
    cluster, seaweed, reference
):
    """One trainer pod per node (3 of a node's 4 CPUs each); trainer-1's node is tainted
    NoSchedule and its pod deleted (a drain): the restarted gang has one pod it cannot
    place, so the job waits — Progressing False, Scheduled False Unschedulable with an
    Event — and goes on from its checkpoint once the taint is removed."""
    bucket, name = "faults-capacity", "below-min"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=16)
    one_trainer_per_node(job)
    # Also torchrun's join timeout: every (re)started gang's pods must join within it,
    # which at 5 s a loaded machine's start-up skew could miss.
    job["spec"]["scheduling"] = {"schedulingTimeoutSeconds": 15}
    cluster.apply(job)
    wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, every=0.5)
    pod = f"{name}-trainer-1"
    node = cluster.pod(NS, pod)["spec"]["nodeName"]
    cluster.kubectl("taint", "nodes", node, "rlft.dev/test=full:NoSchedule")
    try:
        cluster.kubectl("delete", "pod", pod, "-n", NS, "--wait=false")

        def waiting() -> dict[str, Any] | None:
            status = job_status(cluster, name)
            conditions = {c["type"]: c for c in status.get("conditions") or []}
            scheduled = conditions.get("Scheduled", {})
            # The timeout may run out before the scheduler has tried the pod: the
            # condition names the scheduler's reason once it has.
            named = "taint" in scheduled.get("message", "")
            if scheduled.get("status") == "False" and named and status["phase"] != "Running":
                return status
            return None

        status = wait_for(waiting, "the job to wait, naming the taint", timeout=180, every=0.5)
        progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
        assert progressing["status"] == "False", status
        scheduled = next(c for c in status["conditions"] if c["type"] == "Scheduled")
        assert scheduled["reason"] == "Unschedulable"
        assert any(e["reason"] == "Unschedulable" for e in events(cluster, name))
        step = status.get("step")
        time.sleep(5)
        assert job_status(cluster, name).get("step") == step  # no rank trains alone
    finally:
        cluster.kubectl("taint", "nodes", node, "rlft.dev/test=full:NoSchedule-")
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 16)
