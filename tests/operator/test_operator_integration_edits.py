"""The real operator against the emulated API server (not a cluster), driven with the real
kubectl: edits of a job's spec (refused while it runs, applied on resume, new replicas
restarting the trainer gang) and creates a ResourceQuota refuses (a condition, one Event,
retried with backoff, created once the quota is raised)."""

from __future__ import annotations

import json
import math
import time
import urllib.request
from typing import Any

import pytest
import yaml
from cluster import EmulatedApiServer, OperatorProcess, wait_for
from jobs import job_doc
from test_operator_integration import (
    _events,
    _job,
    _namespace,
    _pods,
    _run_all,
    _start_api,
    _started,
    _wait_phase,
)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = _start_api(tmp_path_factory.mktemp("emulated-api-edits"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def operator(api):
    process = OperatorProcess(
        api, "--all-namespaces", "--peering", "rlft-edits", "--priority", "100",
        "--poll-seconds", "2", "--metrics-bind", "[::]:0",
    )  # fmt: skip
    yield process
    process.stop()


def test_the_operators_metrics_listen_on_ipv4_and_ipv6(operator):
    """`--metrics-bind [::]:PORT` (the chart's): one socket for the operator pod's IPv4
    and IPv6 addresses, so Prometheus scrapes it on any cluster's network."""
    port = int(operator.metrics_url.rsplit(":", 1)[1].split("/")[0])
    for host in ("127.0.0.1", "[::1]"):
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as reply:
            assert "rlft_operator_jobs" in reply.read().decode(), host


def _patch(api: EmulatedApiServer, ns: str, name: str, spec: dict[str, Any], check=True) -> Any:
    patch = json.dumps({"spec": spec})
    return api.kubectl("patch", "rlft", name, "-n", ns, "--type=merge", "-p", patch, check=check)


def _job_file(api: EmulatedApiServer, ns: str, name: str) -> dict[str, Any]:
    return yaml.safe_load(api.get("configmap", f"{name}-config", "-n", ns)["data"]["job.yaml"])


def _condition(api: EmulatedApiServer, ns: str, name: str, kind: str) -> dict[str, Any] | None:
    conditions = (_job(api, ns, name).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def _quota(api: EmulatedApiServer, ns: str, pods: int) -> None:
    api.apply(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": "job-pods", "namespace": ns},
            "spec": {"hard": {"pods": str(pods)}},
        }
    )


def test_a_suspended_job_edited_and_resumed_gets_the_new_job_file(api, operator):
    ns = _namespace(api, "edits")
    api.apply(job_doc(name="ed", namespace=ns))
    _started(api, ns, "ed", 2)
    _run_all(api, ns, "ed")
    _wait_phase(api, ns, "ed", "Running")
    refused = _patch(api, ns, "ed", {"trainer": {"learningRate": 0.0001}}, check=False)
    assert refused.returncode != 0, refused.stdout
    assert "spec.trainer.learningRate" in refused.stderr and "suspend it first" in refused.stderr
    _patch(api, ns, "ed", {"suspend": True})
    _wait_phase(api, ns, "ed", "Suspended")
    wait_for(lambda: not _pods(api, ns, "ed"), "the pods to be removed")
    _patch(api, ns, "ed", {"trainer": {"steps": 777, "learningRate": 0.0001}})
    wait_for(
        lambda: _job_file(api, ns, "ed")["spec"]["trainer"]["steps"] == 777,
        "the ConfigMap re-rendered while suspended",
    )
    _patch(api, ns, "ed", {"suspend": False})
    pods = _started(api, ns, "ed", 2)
    trainer = _job_file(api, ns, "ed")["spec"]["trainer"]
    assert (trainer["steps"], trainer["learningRate"]) == (777, 0.0001)
    command = pods["ed-trainer-0"]["spec"]["containers"][0]["command"]
    assert "--resume=auto" in command  # nothing trained here (no trainer): the job's choice
    _run_all(api, ns, "ed")
    job = _wait_phase(api, ns, "ed", "Running")
    wait_for(
        lambda: (
            (j := _job(api, ns, "ed"))["status"].get("observedGeneration")
            == j["metadata"]["generation"]
        ),
        "observedGeneration to reach the resumed generation",
    )
    assert job["status"].get("restarts", 0) == 0


def test_a_running_gang_restarts_with_new_replicas(api, operator):
    ns = _namespace(api, "rescale")
    api.apply(job_doc(name="rs", namespace=ns))
    _started(api, ns, "rs", 2)
    _run_all(api, ns, "rs")
    _wait_phase(api, ns, "rs", "Running")
    old = _pods(api, ns, "rs")["rs-trainer-0"]["metadata"]["uid"]
    _patch(api, ns, "rs", {"trainer": {"replicas": {"min": 1, "max": 2}}})  # accepted

    def regrown() -> dict[str, Any] | None:
        pods = _pods(api, ns, "rs")
        trainer = pods.get("rs-trainer-0")
        new = trainer is not None and trainer["metadata"]["uid"] != old
        return pods if new and "rs-trainer-1" in pods else None

    pods = wait_for(regrown, "the trainer gang recreated with two slots")
    for name in ("rs-trainer-0", "rs-trainer-1"):
        assert "--nnodes=1:2" in pods[name]["spec"]["containers"][0]["command"]
    job = _job(api, ns, "rs")
    assert job["status"].get("restarts", 0) == 0 and job["status"]["gangReplicas"] == "1:2"
    assert "Rescaling" in [r for r, _ in _events(api, ns)]


def test_a_create_refused_by_a_quota_is_a_condition_and_one_event_until_raised(api, operator):
    ns = _namespace(api, "quota")
    _quota(api, ns, pods=1)  # the trainer pod fits, the rollout pod does not
    api.apply(job_doc(name="qu", namespace=ns))

    def refused() -> dict[str, Any] | None:
        created = _condition(api, ns, "qu", "Created")
        return created if created and created["reason"] == "QuotaExceeded" else None

    created = wait_for(refused, "a Created=False condition")
    assert created["status"] == "False"
    assert 'pods "qu-rollout-0" is forbidden: exceeded quota: job-pods' in created["message"]
    assert "limited: pods=1" in created["message"]
    seen = time.monotonic()

    def attempts() -> int:
        return _job(api, ns, "qu")["status"]["createFailure"]["attempts"]

    wait_for(lambda: attempts() >= 2, "a retried create", timeout=60)
    time.sleep(max(0.0, 7 - (time.monotonic() - seen)))
    # With a 2 s poll and pod events a hot retry would try a dozen times in 7 s; doubled
    # waits from 2 s (attempt n + 1 at 2^(n+1) - 2 s) make 3, fewer on a slow machine.
    elapsed, failure = time.monotonic() - seen, _job(api, ns, "qu")["status"]["createFailure"]
    assert failure["attempts"] <= 2 + math.log2(elapsed + 2), (failure, elapsed)
    reasons = [r for r, _ in _events(api, ns)]
    assert reasons.count("QuotaExceeded") == 1, reasons
    assert list(_pods(api, ns, "qu")) == ["qu-trainer-0"]
    _quota(api, ns, pods=4)
    wait_for(lambda: "qu-rollout-0" in _pods(api, ns, "qu"), "the rollout pod", timeout=30)
    wait_for(
        lambda: (_condition(api, ns, "qu", "Created") or {}).get("status") == "True",
        "Created=True",
    )
    status = _job(api, ns, "qu")["status"]
    assert "createFailure" not in status and status["phase"] == "Pending"
    assert "Created" in [r for r, _ in _events(api, ns)]
