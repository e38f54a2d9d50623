"""The real operator process against the emulated API server (not a cluster), driven with
the real kubectl: children and status, restarts with backoff up to maxRestarts, suspend
and resume, deletion through the finalizer, admission of invalid manifests, the trainer's
/status mirrored and a collapse rolled back, and leader election between two replicas."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from cluster import ROOT, EmulatedApiServer, OperatorProcess, wait_for
from jobs import job_doc, on_cluster

from rlft.trainer.config import read_yaml

CRDS = [ROOT / "crds" / "rlfinetune.yaml", ROOT / "crds" / "kopf-peering.yaml"]


class TrainerStatus:
    """A real HTTP server on loopback playing trainer rank 0's /status."""

    def __init__(self) -> None:
        self.document: dict[str, Any] = {}
        board = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(board.document).encode()
                self.send_response(200 if self.path == "/status" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _start_api(workdir) -> EmulatedApiServer:
    api = EmulatedApiServer(workdir)
    for path in CRDS:
        api.kubectl("apply", "--validate=false", "-f", str(path))
    return api


@pytest.fixture(scope="module")
def trainer_status():
    board = TrainerStatus()
    yield board
    board.close()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = _start_api(tmp_path_factory.mktemp("emulated-api"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def operator(api, trainer_status):
    process = OperatorProcess(
        api,
        "--all-namespaces",
        "--peering",
        "rlft-tests",
        "--priority",
        "100",
        "--poll-seconds",
        "2",
        "--trainer-status-port",
        str(trainer_status.port),
    )
    yield process
    process.stop()


# ---------------------------------------------------------------------- helpers


def _namespace(api: EmulatedApiServer, name: str) -> str:
    api.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    return name


def _pods(api: EmulatedApiServer, ns: str, job: str) -> dict[str, dict]:
    listing = api.get("pods", "-n", ns, "-l", f"rlft.dev/job={job}")
    return {p["metadata"]["name"]: p for p in listing["items"]}


def _job(api: EmulatedApiServer, ns: str, name: str) -> dict:
    return api.get("rlft", name, "-n", ns) or {}


def _phase(api: EmulatedApiServer, ns: str, name: str) -> str | None:
    return _job(api, ns, name).get("status", {}).get("phase")


def _wait_phase(api: EmulatedApiServer, ns: str, name: str, phase: str, timeout=20) -> dict:
    wait_for(lambda: _phase(api, ns, name) == phase, f"{ns}/{name} to be {phase}", timeout)
    return _job(api, ns, name)


def _run(api: EmulatedApiServer, ns: str, name: str, pod_ip: str | None = None) -> None:
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": [
            {
                "name": "main",
                "ready": True,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
                "state": {"running": {}},
            }
        ],
    }
    if pod_ip:
        status["podIP"] = pod_ip
    api.set_pod_status(ns, name, status)


def _run_all(api: EmulatedApiServer, ns: str, job: str, pod_ip: str | None = None) -> None:
    for name in _pods(api, ns, job):
        _run(api, ns, name, pod_ip)


def _oom(api: EmulatedApiServer, ns: str, name: str) -> None:
    api.set_pod_status(
        ns,
        name,
        {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "main",
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "",
                    "state": {
                        "terminated": {"exitCode": 137, "reason": "OOMKilled", "message": "Killed"}
                    },
                }
            ],
        },
    )


def _events(api: EmulatedApiServer, ns: str) -> list[tuple[str, str]]:
    listing = api.get("events", "-n", ns)
    return [(e["reason"], e["message"]) for e in listing["items"]]


def _started(api, ns, job, wanted: int) -> dict[str, dict]:
    return wait_for(
        lambda: (p := _pods(api, ns, job)) and len(p) == wanted and p,
        f"{wanted} pods of {ns}/{job}",
    )


# ------------------------------------------------------------------------ tests


def test_apply_the_example_and_see_children_and_status(api, operator):
    ns = _namespace(api, "apply")
    example = ROOT / "examples" / "tiny-grpo.yaml"
    refused = api.kubectl("apply", "--validate=false", "-n", ns, "-f", str(example), check=False)
    assert refused.returncode != 0 and "spec.checkpoint.uri" in refused.stderr
    assert api.get("configmaps", "-n", ns, "-l", "rlft.dev/job=tiny-grpo")["items"] == []
    api.apply(on_cluster(read_yaml(example.read_text())), "-n", ns)
    pods = _started(api, ns, "tiny-grpo", 2)
    assert sorted(pods) == ["tiny-grpo-rollout-0", "tiny-grpo-trainer-0"]
    services = api.get("services", "-n", ns, "-l", "rlft.dev/job=tiny-grpo")["items"]
    assert sorted(s["metadata"]["name"] for s in services) == [
        "tiny-grpo-rollout",
        "tiny-grpo-trainer",
    ]
    config = api.get("configmap", "tiny-grpo-config", "-n", ns)
    assert "kind: RLFineTune" in config["data"]["job.yaml"]
    job = _wait_phase(api, ns, "tiny-grpo", "Pending")
    uid = job["metadata"]["uid"]
    for child in [*pods.values(), config, *services]:
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid
    command = pods["tiny-grpo-trainer-0"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["rlft", "scrubbed", "--", "torchrun"] and "--resume=auto" in command
    _run_all(api, ns, "tiny-grpo")
    job = _wait_phase(api, ns, "tiny-grpo", "Running")
    conditions = {c["type"]: c["status"] for c in job["status"]["conditions"]}
    assert conditions["Scheduled"] == "True" and conditions["Ready"] == "True"
    assert job["status"]["observedGeneration"] == job["metadata"]["generation"]
    table = api.kubectl("get", "rlft", "-n", ns).stdout
    assert table.split("\n")[0].split() == [
        "NAME",
        "PHASE",
        "STEP",
        "REWARD",
        "LASTCHECKPOINT",
        "AGE",
    ]
    assert "tiny-grpo   Running" in table
    reasons = [r for r, _ in _events(api, ns)]
    assert "Creating" in reasons and "Running" in reasons
    # what a running job trains cannot change under it (CEL transition rule)
    doc = job_doc(name="tiny-grpo", namespace=ns, model={"init": {"hiddenSize": 96}})
    rejected = api.apply(doc, check=False)
    assert rejected.returncode != 0 and "cannot change once the job has started" in rejected.stderr


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"trainer": {"replicas": {"min": 3, "max": 2}}}, "spec.trainer.replicas.min"),
        ({"trainer": {"microBatchSize": 0}}, "spec.trainer.microBatchSize"),
        ({"rollout": {"gpusPerInstance": 3, "tensorParallel": 2}}, "spec.rollout.gpusPerInstance"),
    ],
)
def test_invalid_manifest_is_rejected_naming_the_field(api, spec, words):
    result = api.apply(job_doc(name="bad", namespace="default", **spec), check=False)
    assert result.returncode != 0
    assert words in result.stderr and "is invalid" in result.stderr, result.stderr
    assert api.get("rlft", "bad", "-n", "default") is None  # nothing half-created


def test_a_job_its_rollout_pods_could_not_serve_fails_before_any_pod(api, operator):
    """vLLM on rollout pods without GPUs and a model with 16-dimension heads: the trainer
    found out only after its warm start, when the first weights reached the servers."""
    ns = _namespace(api, "heads")
    init = {"family": "qwen3", "hiddenSize": 64, "numHeads": 4, "numKvHeads": 4}
    api.apply(job_doc(name="heads", namespace=ns, rollout={"engine": "vllm"}, model={"init": init}))
    job = _wait_phase(api, ns, "heads", "Failed")
    message = job["status"]["message"]
    assert "heads of at least 32 dimensions; this model's are 16" in message, message
    assert "spec.rollout.gpusPerInstance" in message
    assert job["status"]["lastFailure"]["reason"] == "InvalidConfig"
    assert _pods(api, ns, "heads") == {}
    assert "InvalidSpec" in [r for r, _ in _events(api, ns)]


def test_a_pod_deletion_spares_a_pod_created_since_under_its_name(api):
    """The operator deletes the pod its decision saw (a uid precondition), not another
    replica's replacement created since under the name: the API server refuses 409 and
    the replacement runs on."""
    import asyncio

    from rlft.operator.kube import Connection, Kube

    ns = _namespace(api, "uids")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": ns},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    api.apply(pod)
    seen = api.get("pod", "p", "-n", ns)["metadata"]["uid"]
    api.kubectl("delete", "pod", "p", "-n", ns)
    api.apply(pod)
    replacement = api.get("pod", "p", "-n", ns)["metadata"]["uid"]
    assert replacement != seen

    async def delete(uid: str) -> bool:
        headers = {"Authorization": "Bearer not-a-secret"}
        kube = Kube(Connection(server=api.url, headers=headers))
        try:
            return await kube.delete("Pod", ns, "p", uid=uid)
        finally:
            await kube.close()

    assert asyncio.run(delete(seen)) is False
    assert api.get("pod", "p", "-n", ns)["metadata"]["uid"] == replacement
    assert asyncio.run(delete(replacement)) is True
    assert api.get("pod", "p", "-n", ns) is None


def test_oom_is_restarted_with_backoff_until_max_restarts(api, operator):
    ns = _namespace(api, "oom")
    restart = {"maxRestarts": 2, "backoffSeconds": 2, "windowMinutes": 60}
    api.apply(job_doc(name="oom", namespace=ns, restartPolicy=restart))
    _started(api, ns, "oom", 2)
    _run_all(api, ns, "oom")
    _wait_phase(api, ns, "oom", "Running")
    for n in (1, 2):
        old = _pods(api, ns, "oom")["oom-trainer-0"]["metadata"]["uid"]
        failed_at = time.monotonic()
        _oom(api, ns, "oom-trainer-0")

        def replaced(old=old):
            pod = _pods(api, ns, "oom").get("oom-trainer-0")
            return pod is not None and pod["metadata"]["uid"] != old

        wait_for(replaced, f"trainer pod recreated after OOM #{n}", timeout=30, every=0.1)
        waited = time.monotonic() - failed_at
        backoff = 2 * 2 ** (n - 1)
        assert waited >= backoff, f"recreated after {waited:.2f} s, backoff is {backoff} s"
        job = _job(api, ns, "oom")
        assert job["status"]["restarts"] == n
        assert job["status"]["lastFailure"]["reason"] == "OOMKilled"
        assert job["status"]["lastFailure"]["pod"] == "oom-trainer-0"
        command = _pods(api, ns, "oom")["oom-trainer-0"]["spec"]["containers"][0]["command"]
        assert "--resume=auto" in command  # no trainer here, so no checkpoint of the job's
        _run(api, ns, "oom-trainer-0")
        _wait_phase(api, ns, "oom", "Running")
    _oom(api, ns, "oom-trainer-0")
    job = _wait_phase(api, ns, "oom", "Failed")
    assert job["status"]["lastFailure"]["reason"] == "TooManyRestarts"
    assert job["status"]["restarts"] == 2
    wait_for(lambda: "oom-rollout-0" not in _pods(api, ns, "oom"), "the rollout pod deleted")
    time.sleep(2.5)  # more than the last backoff: nothing comes back
    assert list(_pods(api, ns, "oom")) == ["oom-trainer-0"]  # the failed pod, kept for its logs
    reasons = [r for r, _ in _events(api, ns)]
    assert reasons.count("Restarting") == 2 and "Failed" in reasons
    assert 'rlft_restarts_total{rlfinetune="oom/oom"} 2.0' in operator.metrics()


def test_suspend_and_resume(api, operator):
    ns = _namespace(api, "suspend")
    api.apply(job_doc(name="sus", namespace=ns))
    _started(api, ns, "sus", 2)
    _run_all(api, ns, "sus")
    _wait_phase(api, ns, "sus", "Running")
    api.kubectl("patch", "rlft", "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":true}}')
    _wait_phase(api, ns, "sus", "Suspended")
    wait_for(lambda: not _pods(api, ns, "sus"), "the pods to be removed")
    assert api.get("configmap", "sus-config", "-n", ns) is not None  # the rest stays
    api.kubectl(
        "patch", "rlft", "sus", "-n", ns, "--type=merge", "-p", '{"spec":{"suspend":false}}'
    )
    pods = _started(api, ns, "sus", 2)
    # Nothing trained (no trainer here): the job's own choice again.
    assert "--resume=auto" in pods["sus-trainer-0"]["spec"]["containers"][0]["command"]
    _wait_phase(api, ns, "sus", "Pending")
    _run_all(api, ns, "sus")
    _wait_phase(api, ns, "sus", "Running")
    reasons = [r for r, _ in _events(api, ns)]
    assert "Suspended" in reasons and "Resumed" in reasons


def test_delete_runs_the_finalizer(api, operator):
    ns = _namespace(api, "delete")
    api.apply(job_doc(name="gone", namespace=ns, checkpoint={"uri": "s3://ckpt/gone"}))
    # A user's own object that carries the job's label, not the operator's mark: the
    # finalizer deleted it too (it selected by the job label alone).
    notes = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"a": "b"}}
    notes["metadata"] = {"name": "gone-notes", "namespace": ns, "labels": {"rlft.dev/job": "gone"}}
    api.apply(notes)
    _started(api, ns, "gone", 2)
    job = wait_for(
        lambda: (j := _job(api, ns, "gone")) and j["metadata"].get("finalizers") and j,
        "the finalizer to be added",
    )
    assert "rlft.dev/finalizer" in job["metadata"]["finalizers"]
    api.kubectl("delete", "rlft", "gone", "-n", ns, "--timeout=30s")
    assert api.get("rlft", "gone", "-n", ns) is None
    assert _pods(api, ns, "gone") == {}
    assert api.get("services", "-n", ns, "-l", "rlft.dev/job=gone")["items"] == []
    assert api.get("configmap", "gone-config", "-n", ns) is None
    assert api.get("configmap", "gone-notes", "-n", ns)["data"] == {"a": "b"}
    messages = [m for r, m in _events(api, ns) if r == "Deleted"]
    assert messages and "checkpoints kept at s3://ckpt/gone" in messages[0]


def test_status_is_mirrored_and_a_collapse_left_to_the_trainer(api, operator, trainer_status):
    ns = _namespace(api, "collapse")
    ckpt = {"step": 40, "uri": "s3://b/c/step-000040", "time": "2026-01-01T00:00:00Z"}
    trainer_status.document = {
        "step": 42,
        "policyVersion": 42,
        "phase": "training",
        "health": "ok",
        "reward": 0.5,
        "lastCheckpoint": ckpt,
        "lastHealthyCheckpoint": ckpt,
        "rollbacks": 0,
        "skippedUpdates": 0,
        "events": [],
    }
    api.apply(job_doc(name="col", namespace=ns, stability={"onCollapse": "rollback"}))
    _started(api, ns, "col", 2)
    _run_all(api, ns, "col", pod_ip="127.0.0.1")
    wait_for(lambda: _job(api, ns, "col").get("status", {}).get("step") == 42, "step 42 mirrored")
    status = _job(api, ns, "col")["status"]
    assert status["reward"] == 0.5 and status["lastCheckpoint"]["step"] == 40
    assert status["lastCheckpoint"]["healthy"] is True
    row = api.kubectl("get", "rlft", "-n", ns).stdout.splitlines()[1].split()
    assert row[:5] == ["col", "Running", "42", "0.5", "40"]
    old = _pods(api, ns, "col")["col-trainer-0"]["metadata"]["uid"]
    trainer_status.document = {
        **trainer_status.document,
        "step": 60,
        "health": "collapsed",
        "rollbacks": 1,
        "lastCheckpoint": {**ckpt, "step": 60},
    }

    def collapsed():
        status = _job(api, ns, "col").get("status", {})
        conditions = {c["type"]: c for c in status.get("conditions", [])}
        return conditions.get("Healthy", {}).get("reason") == "Collapsed" and status

    status = wait_for(collapsed, "the collapse shown in the Healthy condition")
    # One owner: the trainer rolls back in process; the operator restarts nothing.
    assert status["phase"] == "Running" and status.get("restarts", 0) == 0
    assert status["rollbacks"] == 1 and status["lastCheckpoint"]["step"] == 60
    assert _pods(api, ns, "col")["col-trainer-0"]["metadata"]["uid"] == old
    # Events are posted after the status write (a courtesy; the status says it first).
    wait_for(lambda: [r for r, _ in _events(api, ns)].count("Collapsed") >= 1, "a Collapsed Event")
    assert [r for r, _ in _events(api, ns)].count("Collapsed") == 1


def test_leader_election_between_two_replicas(tmp_path):
    api = _start_api(tmp_path / "api")
    args = ["-n", "default", "--peering", "rlft", "--poll-seconds", "2", "--peering-lifetime", "30"]
    leader = standby = None
    try:
        leader = OperatorProcess(api, *args, "--priority", "200", name="leader")
        standby = OperatorProcess(api, *args, "--priority", "100", name="standby")
        wait_for(lambda: "Pausing operations in favour of" in standby.log(), "the standby to pause")
        api.apply(job_doc(name="first", namespace="default"))
        _started(api, "default", "first", 2)
        wait_for(lambda: "Creating" in leader.log(), "the leader to reconcile")
        assert "default/first" not in standby.log()
        leader.stop(signal.SIGTERM)  # a graceful exit leaves the peering at once
        # Past the 30 s peering lifetime: a leader slow to exit (killed at stop's
        # deadline) leaves its peering entry until then.
        wait_for(
            lambda: "Resuming operations" in standby.log(), "the standby to take over", timeout=60
        )
        api.apply(job_doc(name="second", namespace="default"))
        _started(api, "default", "second", 2)
        assert "default/second: Creating" in standby.log()
        # A replica of higher priority comes back: the standby pauses, and nothing of
        # it reconciles any more (its own wake-ups went on, beside the new leader, and
        # killed gangs the new leader had restarted).
        leader = OperatorProcess(api, *args, "--priority", "300", name="newer")
        wait_for(lambda: standby.log().count("Pausing operations") == 2, "the standby to pause")
        wait_for(lambda: _reconciles(leader) >= 4, "the new leader to reconcile both jobs")
        # Only the replica that serves the jobs counts them: summed over the replicas
        # (as a dashboard does), the paused one's last count would double them.
        wait_for(lambda: _jobs(leader) == 2, "the new leader to count both jobs")
        # Zero once both of its jobs' daemons have ended (their clean-up clears the
        # count): a reconcile in flight as it paused may still count until then.
        wait_for(lambda: _jobs(standby) == 0, "the paused replica to count none")
        # A reconcile that began before the pause may still finish (and count) after it.
        (before,) = wait_for(lambda: _settled(standby), "the paused replica's last reconcile")
        time.sleep(5)  # more than two --poll-seconds
        assert _reconciles(standby) == before
        assert _jobs(standby) == 0
    finally:
        for process in (standby, leader):
            if process is not None:
                process.stop()
        api.stop()


def _jobs(process: OperatorProcess) -> float:
    found = re.findall(r"^rlft_operator_jobs\{[^}]*\} (\S+)$", process.metrics(), re.M)
    return sum(float(v) for v in found)


def _settled(process: OperatorProcess) -> tuple[float] | None:
    """(its reconcile count) when the count stayed the same for over a --poll-seconds."""
    first = _reconciles(process)
    time.sleep(2.5)
    return (first,) if _reconciles(process) == first else None


def _reconciles(process: OperatorProcess) -> float:
    found = re.findall(r"^rlft_operator_reconciles_total\{[^}]*\} (\S+)$", process.metrics(), re.M)
    return sum(float(v) for v in found)
