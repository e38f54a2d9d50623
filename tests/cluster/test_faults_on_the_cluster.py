"""Faults injected into running jobs on the test cluster: the real operator, torchrun and
`rlft train` recover by themselves and the job reaches Succeeded. Each test injects its
fault into real processes (by process id, from the kubelet's records)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import pytest
from cluster_jobs import ALGORITHMS, NS, finished, rlft, tiny_job
from faults import (
    assert_data_exactly_once,
    checkpointed,
    events,
    faulty_job,
    kept_history,
    start_oom,
    worker_of,
)
from kube_api import core_path
from s3_proxy import S3Proxy
from testcluster import wait_for


def test_a_trainer_killed_before_the_first_checkpoint_restarts_from_the_start(
    cluster, seaweed, reference
):
    """SIGKILL of trainer-0's container during the warm start: the job has no checkpoint
    of its own, so the operator restarts the gang with the job's own resume choice
    (`auto`), which starts the job again instead of failing for want of a checkpoint."""
    bucket, name = "faults-early", "early-kill"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket)
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
    assert any(e["reason"] == "Restarting" for e in events(cluster, name))
    restarted = cluster.api.get("pods", NS, pod)
    assert restarted["spec"]["containers"][0]["command"][-1] == "--resume=auto"
    client = seaweed.client()
    summary = client.get_object(Bucket=bucket, Key=f"{name}/outputs/summary.json")["Body"]
    assert json.loads(summary.read())["steps"] == 12
    assert_data_exactly_once(kept_history(client, bucket, name), reference, 12)


def test_a_trainer_rank_killed_mid_step_resumes_from_the_last_checkpoint(
    cluster, seaweed, reference
):
    """SIGKILL of trainer-0's worker process (not its pod) after a checkpoint: torchrun restarts
    the workers of both pods, which resume from the newest checkpoint; the job completes
    and no committed checkpoint is lost."""
    bucket, name = "faults-rank", "rank-kill"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=16)
    cluster.apply(job)
    pod = f"{name}-trainer-0"

    saved = wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, 0.5)
    worker = worker_of(cluster, pod)
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
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 16)
    print(f"recovered {time.monotonic() - killed_at:.1f} s after the kill; resumed at {resumed}")


@pytest.mark.parametrize(
    ("deleted", "evicted"), [(0, False), (1, True)], ids=["rendezvous-host", "peer-evicted"]
)
def test_a_preempted_trainer_pod_checkpoints_in_its_grace_and_the_job_resumes_from_it(
    cluster, seaweed, reference, deleted, evicted
):
    """One trainer pod deleted mid-run, by `kubectl delete pod` or evicted through the
    Eviction API as a drain does (the DisruptionTarget condition, then the same graceful
    delete): the kubelet sends SIGTERM, every rank writes the emergency checkpoint inside
    the grace and stops; the operator restarts the gang, which resumes from that
    checkpoint, and the job completes. The eviction is a disruption, not counted against
    restartPolicy; a plain delete is counted. Deleting the peer (trainer-1) is the hard
    case: the rendezvous host's torchrun agent would wait in its exit barrier for the
    SIGTERMed agent, holding its pod's name past the whole grace; the old pods must be
    gone well within it."""
    bucket, name = f"faults-preempt-{deleted}", f"preempted-{deleted}"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=24)
    job["spec"]["checkpoint"]["intervalSteps"] = 1000  # only the emergency one can be used
    grace = job["spec"]["checkpoint"]["gracePeriodSeconds"] = 60
    cluster.apply(job)
    pods = [f"{name}-trainer-0", f"{name}-trainer-1"]
    wait_for(lambda: all(cluster.pod(NS, p) for p in pods), "the trainer pods", 60)
    first_uids = {cluster.pod(NS, p)["metadata"]["uid"] for p in pods}

    def stepping() -> int | None:
        return ((rlft(cluster, name) or {}).get("status") or {}).get("step")

    wait_for(lambda: (stepping() or 0) >= 3, "a few RL steps", timeout=300, every=0.5)
    first_folders = [cluster.pod_folder(NS, p) for p in pods]  # rank 0 may be either
    deleted_at = time.monotonic()
    if evicted:
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction"}
        eviction["metadata"] = {"name": pods[deleted], "namespace": NS}
        cluster.api.request("POST", core_path("pods", NS, pods[deleted]) + "/eviction", eviction)
    else:
        cluster.kubectl("delete", "pod", pods[deleted], "-n", NS, "--wait=false")

    def old_pods_gone() -> bool:
        current = {(cluster.pod(NS, p) or {}).get("metadata", {}).get("uid") for p in pods}
        return not current & first_uids

    wait_for(old_pods_gone, "the first gang's pods to go", timeout=grace, every=0.5)
    gone_after = time.monotonic() - deleted_at
    assert gone_after < grace / 2, f"the old pods took {gone_after:.0f} s of a {grace} s grace"
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status["restarts"] == 1, json.dumps(status, indent=1)
    if evicted:
        assert status["lastFailure"]["reason"] == "Evicted", json.dumps(status, indent=1)
        assert "not counted against restartPolicy" in status["lastFailure"]["action"]
        assert not status.get("restartHistory"), json.dumps(status, indent=1)
    else:
        assert len(status["restartHistory"]) == 1, json.dumps(status, indent=1)
    first_logs = "".join((f / "main.log").read_text(errors="replace") for f in first_folders)
    stopped = first_logs.split("stopped after the emergency checkpoint of step ")
    assert len(stopped) > 1, first_logs[-3000:]
    step = int(stopped[1].split(";")[0].split()[0])
    again = "".join(cluster.logs(NS, p) for p in pods)
    assert f"resumed from the checkpoint of step {step}" in again, again[-3000:]
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 24)


def test_a_trainer_pod_oom_killed_by_its_memory_limit_is_restarted(cluster, seaweed, reference):
    """The trainer container's real memory cgroup pushed over its limit (a process joins
    it and allocates): the kernel's OOM killer kills the trainer (its oom_score_adj
    raised to 1000, what a kubelet gives a BestEffort container; lowering the
    allocator's own needs CAP_SYS_RESOURCE), the kubelet reports OOMKilled, the operator
    restarts the gang, counted, and the job completes from its checkpoint."""
    bucket, name = "faults-oom", "oom-kill"
    seaweed.create_bucket(bucket)
    # 24 steps: with 16 the job could end before the allocator (started once the first
    # checkpoint is committed, on a loaded machine) filled the cgroup.
    job = faulty_job(name, bucket, steps=24)
    job["spec"]["trainer"]["resources"]["limits"] = {"memory": "3Gi"}
    cluster.apply(job)
    pod = f"{name}-trainer-0"
    saved = wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, 0.5)
    allocator = start_oom(cluster, pod)
    _, errors = allocator.communicate(timeout=120)
    # The allocator may go too, once the trainer's memory is freed (what the kernel
    # kills next is its choice): the container's end and its reason are what count.
    assert allocator.returncode in (0, -signal.SIGKILL), errors
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    # Which pod is judged first is a race: the OOM-killed rank's, or its peer's (its
    # collective broke). Either way the OOMKilled is the failure the status names.
    assert status["lastFailure"]["reason"] == "OOMKilled", status["lastFailure"]
    assert status["lastFailure"]["pod"] == pod
    assert any(e["reason"] == "OOMKilled" or "OOMKilled" in e["message"]
               for e in events(cluster, name))  # fmt: skip
    assert status["restarts"] >= 1
    logs = cluster.logs(NS, pod) + cluster.logs(NS, f"{name}-trainer-1")
    resumed = int(logs.split("resumed from the checkpoint of step ")[1].split()[0])
    assert resumed >= saved
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 24)


def test_a_nan_and_a_persistent_blowup_are_handled_in_process_and_alerted(
    cluster, seaweed, prometheus
):
    """Faults planted into the real loop through the trainer pods' env (RLFT_PLANT_FAULTS):
    a NaN gradient at step 12 (its update skipped), then a gradient blow-up on steps
    20–25 (rolled back to the last healthy checkpoint). The trainer owns both: no pod
    restarts, the job completes, and the real Prometheus scraping the pods fires
    RLFTNonFiniteValues and RLFTRolledBack. DPO on 2 trainer pods: the tiny GRPO job's
    rewards are all 0, so its gradients are too, and scaling them blows nothing up."""
    bucket, name = "faults-collapse", "collapse"
    seaweed.create_bucket(bucket)
    job = tiny_job(name, bucket, ALGORITHMS["dpo"])
    job["spec"]["trainer"]["steps"] = 30
    job["spec"]["checkpoint"]["intervalSteps"] = 5
    planted = [
        {"kind": "grad_scale", "from": 12, "to": 13, "factor": float("nan")},
        {"kind": "grad_scale", "from": 20, "to": 26, "factor": 100},
    ]
    job["spec"]["trainer"]["env"] = [{"name": "RLFT_PLANT_FAULTS", "value": json.dumps(planted)}]
    cluster.apply(job)
    wanted, fired = {"RLFTNonFiniteValues", "RLFTRolledBack"}, set()

    def done_and_alerted() -> dict | None:
        fired.update(
            a["labels"]["alertname"] for a in prometheus.alerts() if a["state"] == "firing"
        )
        job = finished(cluster, name)
        return job if job is not None and wanted <= fired else None

    done = wait_for(done_and_alerted, f"{name} to finish and alert", timeout=600, every=1)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status.get("restarts", 0) == 0 and status["rollbacks"] >= 1, status
    history = kept_history(seaweed.client(), bucket, name)
    actions = {r["step"]: r["guard_action"] for r in history if r["guard_action"] != "apply"}
    assert actions.get(12) == "skip" and "rollback" in actions.values(), actions
    assert set(actions) <= {12, *range(20, 26)}, actions  # only the planted steps
    logs = cluster.logs(NS, f"{name}-trainer-0") + cluster.logs(NS, f"{name}-trainer-1")
    assert "rolled back to the healthy checkpoint of step" in logs
    assert [r["step"] for r in history] == list(range(1, 31))  # each step kept once


@pytest.fixture
def proxied_store(cluster, seaweed) -> Iterator[S3Proxy]:
    """The session's SeaweedFS behind a proxy that can stall uploads, as the Secret
    `s3-proxied`."""
    proxy = S3Proxy(seaweed.endpoint)
    credentials = seaweed.credentials() | {"AWS_ENDPOINT_URL": proxy.url}
    cluster.create_secret(NS, "s3-proxied", credentials)
    try:
        yield proxy
    finally:
        proxy.stop()


def test_a_trainer_killed_during_a_checkpoint_upload_resumes_from_the_previous_one(
    cluster, seaweed, proxied_store, reference
):
    """The next checkpoint's uploads are held in flight by the proxy, and trainer-0's
    container is SIGKILLed meanwhile: that checkpoint never commits (its manifest is
    never written), and the restarted gang resumes from the last committed one — never
    from the torn folder — and completes."""
    bucket, name = "faults-upload", "upload-kill"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=16)
    job["spec"]["checkpoint"]["credentialsSecret"] = "s3-proxied"
    cluster.apply(job)
    wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, every=0.5)
    proxied_store.hold(f"/{bucket}/{name}/step-")
    wait_for(lambda: proxied_store.held, "a checkpoint upload in flight", 120, every=0.05)
    torn = int(proxied_store.held_paths[0].split("/step-")[1][:6])
    committed = checkpointed(cluster, name)
    cluster.kill_container(NS, f"{name}-trainer-0")
    proxied_store.release()
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status["restarts"] >= 1
    logs = cluster.logs(NS, f"{name}-trainer-0") + cluster.logs(NS, f"{name}-trainer-1")
    resumed = int(logs.split("resumed from the checkpoint of step ")[1].split()[0])
    assert committed <= resumed < torn, (committed, resumed, torn)
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 16)


def test_a_hung_trainer_rank_fails_its_liveness_and_the_gang_restarts(cluster, seaweed, reference):
    """Rank 1 hangs for good at step 8, before the step's first collective (a planted
    `hang` in RLFT_PLANT_FAULTS, first gang only), so rank 0 blocks in that collective:
    neither makes progress. With stallTimeoutSeconds 20 each pod's liveness endpoint
    answers 503 twenty seconds after its rank's last progress, and each rank's verdict
    says it stalled before anything kills it; the kubelet's liveness probe kills the
    container (with restartPolicy Never its pod ends Failed, exit code and reason Error
    only), the operator reads `stalled`, restarts the gang from the last checkpoint
    (counted), and the job completes with every step's data trained once."""
    bucket, name = "faults-hang", "hang"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=16)
    job["spec"]["trainer"]["stallTimeoutSeconds"] = 20
    planted = [{"kind": "hang", "rank": 1, "at": 8}]
    job["spec"]["trainer"]["env"] = [{"name": "RLFT_PLANT_FAULTS", "value": json.dumps(planted)}]
    cluster.apply(job)
    pods = [f"{name}-trainer-0", f"{name}-trainer-1"]
    line = "planted fault: rank 1 hangs at step 8"

    def hung_pod() -> str | None:
        return next((p for p in pods if line in cluster.logs(NS, p)), None)

    hung = wait_for(hung_pod, "rank 1 to hang at step 8", timeout=400, every=1)
    first_folders = [cluster.pod_folder(NS, p) for p in pods]
    hung_at = time.monotonic()

    def killed() -> list[dict]:
        return [
            e
            for p in pods
            for e in events(cluster, p)
            if e["reason"] == "Killing" and "failed liveness probe" in e["message"]
        ]

    assert wait_for(killed, "a liveness kill", timeout=120, every=0.5)
    print(f"killed by its liveness probe {time.monotonic() - hung_at:.1f} s after the hang")
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    first_logs = "".join((f / "main.log").read_text(errors="replace") for f in first_folders)
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1) + first_logs[-4000:]
    assert status["restarts"] >= 1
    failure = status["lastFailure"]
    assert failure["reason"] == "Stalled" and failure["pod"] in pods, failure
    assert "stalled" in failure["message"] and "no progress for" in failure["message"]
    restarting = [e for e in events(cluster, name) if e["reason"] == "Restarting"]
    assert any("stalled" in e["message"].lower() for e in restarting), restarting
    again = "".join(cluster.logs(NS, p) for p in pods)
    assert line not in again  # the restarted gang (attempt 1) runs through
    resumed = int(again.split("resumed from the checkpoint of step ")[1].split()[0])
    assert resumed < 8, (resumed, hung)
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 16)
