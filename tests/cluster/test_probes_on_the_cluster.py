"""The process kubelet's probes on real processes: readiness sets the pod's Ready, the
startup probe holds the liveness probe back, and a failed liveness probe stops the
container as a kubelet does (SIGTERM, SIGKILL after the probe's grace), restarted per
restartPolicy: with Never the pod ends Failed with only an exit code and reason Error,
and Unhealthy and Killing Events on the pod. (The rules alone: test_probe_rules.py.)"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
from testcluster import ProcessCluster, wait_for

NS = "default"

# Serves GET /live and /ready on the pod's own address; what they answer follows files
# the test can create in the pod's emptyDir (its host folder, found through the kubelet).
SERVER = """
import http.server, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
os.makedirs("/flags", exist_ok=True)
delay = float(os.environ.get("BIND_AFTER", "0"))
time.sleep(delay)
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        flag = {"/live": "/flags/dead", "/ready": "/flags/unready"}.get(self.path)
        bad = flag is not None and os.path.exists(flag)
        self.send_response(503 if bad else 200); self.end_headers()
    def log_message(self, *args): pass
print("serving", flush=True)
http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8090), Answer).serve_forever()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("probes"), nodes=1) as running:
        yield running


def probed(name: str, policy: str = "Never", bind_after: float = 0, **probes: Any) -> dict:
    container = {
        "name": "main",
        "image": "python:3.11-slim",
        "command": ["python", "-c", textwrap.dedent(SERVER)],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "BIND_AFTER", "value": str(bind_after)},
        ],
        "ports": [{"name": "http", "containerPort": 8090}],
        "volumeMounts": [{"name": "flags", "mountPath": "/flags"}],
        **probes,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "restartPolicy": policy,
            "terminationGracePeriodSeconds": 30,
            "containers": [container],
            "volumes": [{"name": "flags", "emptyDir": {}}],
        },
    }


def probe(path: str, **numbers: Any) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 1, **numbers}


def flag(cluster: ProcessCluster, name: str, which: str, present: bool = True) -> None:
    path = cluster.pod_folder(NS, name) / "volumes" / "flags" / which
    path.unlink(missing_ok=True) if not present else path.write_text("")


def main_status(cluster: ProcessCluster, name: str) -> dict[str, Any]:
    statuses = ((cluster.pod(NS, name) or {}).get("status") or {}).get("containerStatuses")
    return (statuses or [{}])[0]


def ready(cluster: ProcessCluster, name: str) -> bool:
    conditions = ((cluster.pod(NS, name) or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def pod_events(cluster: ProcessCluster, name: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.api.list("events", NS)
        if e["involvedObject"].get("kind") == "Pod" and e["involvedObject"]["name"] == name
    ]


def test_readiness_sets_ready_and_follows_the_endpoint(cluster):
    cluster.apply(probed("readied", readinessProbe=probe("/ready", failureThreshold=1)))
    cluster.wait_pod(NS, "readied", "Running")
    wait_for(lambda: ready(cluster, "readied"), "readied to be Ready", 30)
    flag(cluster, "readied", "unready")
    wait_for(lambda: not ready(cluster, "readied"), "readied to be not Ready", 30)
    assert main_status(cluster, "readied")["started"]  # not ready, still running
    assert any(
        e["reason"] == "Unhealthy" and e["message"].startswith("Readiness probe failed")
        for e in pod_events(cluster, "readied")
    )
    flag(cluster, "readied", "unready", present=False)
    wait_for(lambda: ready(cluster, "readied"), "readied to be Ready again", 30)
    cluster.kubectl("delete", "pod", "readied", "--wait=false", "--grace-period=1")
    cluster.wait_pod(NS, "readied", gone=True, timeout=40)


def test_a_failed_liveness_probe_stops_the_container_and_never_restarts_it(cluster):
    """SIGTERM (ignored by this process), SIGKILL after the probe's own grace (2 s, not the
    pod's 30), then Failed: exit code 137, reason Error, as a kubelet reports it."""
    live = probe("/live", failureThreshold=2, terminationGracePeriodSeconds=2)
    cluster.apply(probed("hung", livenessProbe=live))
    cluster.wait_pod(NS, "hung", "Running")
    wait_for(lambda: "serving" in cluster.logs(NS, "hung"), "hung to serve", 30)
    time.sleep(3)
    assert main_status(cluster, "hung")["state"].get("running")  # healthy: left alone
    flag(cluster, "hung", "dead")
    flagged = time.monotonic()
    done = cluster.wait_pod(NS, "hung", "Failed", timeout=30)
    took = time.monotonic() - flagged
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (137, "Error")
    assert done["status"]["containerStatuses"][0]["restartCount"] == 0
    assert "SIGTERM ignored" in cluster.logs(NS, "hung")
    assert 2 <= took < 15, took  # two failed probes a second apart, then the 2 s grace
    reasons = {(e["reason"], e["message"]) for e in pod_events(cluster, "hung")}
    assert ("Killing", "Container main failed liveness probe, will be restarted") in reasons
    assert (
        "Unhealthy",
        "Liveness probe failed: HTTP probe failed with statuscode: 503",
    ) in reasons


def test_the_startup_probe_holds_the_liveness_probe_back(cluster):
    """The server binds only after 4 s: a liveness probe that fails at once would kill it,
    but it waits for the startup probe, and the container stays up, not started and not
    ready until then."""
    startup = probe("/live", failureThreshold=20)
    live = probe("/live", failureThreshold=1)
    cluster.apply(probed("slow-start", bind_after=4, startupProbe=startup, livenessProbe=live))
    cluster.wait_pod(NS, "slow-start", "Running")
    status = main_status(cluster, "slow-start")
    assert not status["started"] and not status["ready"] and not ready(cluster, "slow-start")
    wait_for(lambda: main_status(cluster, "slow-start").get("started"), "the startup probe", 30)
    assert ready(cluster, "slow-start")
    assert main_status(cluster, "slow-start")["restartCount"] == 0
    assert not any(e["reason"] == "Killing" for e in pod_events(cluster, "slow-start"))
    cluster.kubectl("delete", "pod", "slow-start", "--wait=false", "--grace-period=1")
    cluster.wait_pod(NS, "slow-start", gone=True, timeout=40)


def test_a_startup_probe_that_never_succeeds_kills_the_container(cluster):
    startup = probe("/live", failureThreshold=3, terminationGracePeriodSeconds=1)
    cluster.apply(probed("never-up", bind_after=3600, startupProbe=startup))
    done = cluster.wait_pod(NS, "never-up", "Failed", timeout=30)
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Error"
    assert any(
        e["message"] == "Container main failed startup probe, will be restarted"
        for e in pod_events(cluster, "never-up")
    )


def test_with_restart_policy_always_a_liveness_kill_restarts_the_container(cluster):
    live = probe("/live", failureThreshold=1, terminationGracePeriodSeconds=1)
    cluster.apply(probed("restarted", policy="Always", livenessProbe=live))
    cluster.wait_pod(NS, "restarted", "Running")
    wait_for(lambda: "serving" in cluster.logs(NS, "restarted"), "restarted to serve", 30)
    flag(cluster, "restarted", "dead")  # the emptyDir outlives the container: dead again
    wait_for(
        lambda: main_status(cluster, "restarted").get("restartCount", 0) >= 1,
        "a restart after the liveness kill",
        30,
    )
    last = main_status(cluster, "restarted")["lastState"]["terminated"]
    assert last["reason"] == "Error"
    flag(cluster, "restarted", "dead", present=False)
    cluster.kubectl("delete", "pod", "restarted", "--wait=false", "--grace-period=1")
    cluster.wait_pod(NS, "restarted", gone=True, timeout=40)
