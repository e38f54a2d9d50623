"""The process kubelet's probes without a cluster: thresholds, the startup probe's gate,
readiness, what a failed liveness or startup probe decides, the kubelet's words, and one
real HTTP probe. (On the cluster, with real processes: test_probes_on_the_cluster.py.)"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from probes import ContainerProbes, ProbeSpec, ProbeState, http_check, probe_specs


def spec(kind: str, **kw) -> ProbeSpec:
    return ProbeSpec(kind=kind, url="http://127.0.0.9:1/x", **kw)


def test_a_result_flips_after_its_threshold_in_a_row():
    state = ProbeState(spec("livenessProbe", failure_threshold=3))
    assert not state.record(False) and not state.record(False)
    assert not state.record(True)  # a success in between starts the count again
    assert not state.record(False) and not state.record(False)
    assert state.record(False) and state.result is False
    ready = ProbeState(spec("readinessProbe", success_threshold=2, failure_threshold=1))
    assert ready.result is None and not ready.record(True)
    assert ready.record(True) and ready.result is True
    assert ready.record(False) and ready.result is False


def test_liveness_and_readiness_wait_for_the_startup_probe():
    probes = ContainerProbes(
        "main",
        {
            "startupProbe": spec("startupProbe", failure_threshold=30),
            "livenessProbe": spec("livenessProbe", failure_threshold=1),
            "readinessProbe": spec("readinessProbe"),
        },
    )
    assert not probes.started and not probes.ready
    probes.observe("startupProbe", False, "connection refused")
    assert not probes.started and probes.kill is None and not probes.events
    probes.observe("startupProbe", True)
    assert probes.started and not probes.ready  # not ready before readiness succeeds
    probes.observe("readinessProbe", True)
    assert probes.ready
    probes.observe("readinessProbe", False)
    probes.observe("readinessProbe", False)
    probes.observe("readinessProbe", False, "HTTP probe failed with statuscode: 503")
    assert not probes.ready and probes.kill is None
    assert probes.drain_events() == [
        ("Warning", "Unhealthy", "Readiness probe failed: HTTP probe failed with statuscode: 503")
    ]


def test_a_failed_liveness_probe_kills_with_the_probes_grace():
    probes = ContainerProbes("main", {"livenessProbe": spec("livenessProbe", grace=15)})
    assert probes.started and probes.ready  # no startup or readiness probe
    for _ in range(3):
        probes.observe("livenessProbe", False, "HTTP probe failed with statuscode: 503")
    assert probes.kill is not None and probes.kill.grace == 15 and not probes.ready
    assert probes.drain_events() == [
        ("Warning", "Unhealthy", "Liveness probe failed: HTTP probe failed with statuscode: 503"),
        ("Normal", "Killing", "Container main failed liveness probe, will be restarted"),
    ]
    probes.observe("livenessProbe", True)  # a killed container is probed no more
    assert probes.kill is not None and not probes.drain_events()


def test_a_startup_probe_that_never_succeeds_kills():
    probes = ContainerProbes("main", {"startupProbe": spec("startupProbe", failure_threshold=2)})
    probes.observe("startupProbe", False, "refused")
    probes.observe("startupProbe", False, "refused")
    assert probes.kill is not None
    assert "failed startup probe" in probes.kill.message


def test_specs_from_a_container():
    container = {
        "ports": [{"name": "liveness", "containerPort": 8081}],
        "livenessProbe": {
            "httpGet": {"path": "/livez", "port": "liveness"},
            "periodSeconds": 2,
            "terminationGracePeriodSeconds": 15,
        },
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8000, "host": "127.0.0.5"}},
        "startupProbe": {"exec": {"command": ["true"]}},  # not emulated
    }
    specs = probe_specs(container, "127.0.1.7", pod_grace=75)
    assert set(specs) == {"livenessProbe", "readinessProbe"}
    live, ready = specs["livenessProbe"], specs["readinessProbe"]
    assert live.url == "http://127.0.1.7:8081/livez" and live.period == 2 and live.grace == 15
    assert (live.timeout, live.failure_threshold, live.initial_delay) == (1, 3, 0)
    assert ready.url == "http://127.0.0.5:8000/healthz" and ready.grace == 75


class _Answers(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow":
            time.sleep(1.5)
        code = {"/ok": 200, "/moved": 302, "/down": 503}.get(self.path, 200)
        self.send_response(code)
        if code == 302:
            self.send_header("Location", "/ok")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_an_http_probe_succeeds_on_2xx_and_3xx_only_and_in_time():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert http_check(ProbeSpec("livenessProbe", f"{base}/ok")) == (True, "")
        assert http_check(ProbeSpec("livenessProbe", f"{base}/moved"))[0]
        ok, why = http_check(ProbeSpec("livenessProbe", f"{base}/down"))
        assert not ok and why == "HTTP probe failed with statuscode: 503"
        assert not http_check(ProbeSpec("livenessProbe", f"{base}/slow", timeout=0.5))[0]
    finally:
        server.shutdown()
        server.server_close()
    ok, why = http_check(ProbeSpec("livenessProbe", f"{base}/ok"))
    assert not ok and why.startswith(f'Get "{base}/ok"')  # nothing listens any more


def test_the_workers_probe_a_real_endpoint_on_their_schedule():
    answers = {"code": 200}

    def check(probe: ProbeSpec) -> tuple[bool, str]:
        seen.append((probe.kind, time.monotonic()))
        return answers["code"] == 200, f"HTTP probe failed with statuscode: {answers['code']}"

    seen: list[tuple[str, float]] = []
    probes = ContainerProbes(
        "main",
        {
            "startupProbe": ProbeSpec("startupProbe", "u", period=0.1, failure_threshold=50),
            "livenessProbe": ProbeSpec("livenessProbe", "u", period=0.1, initial_delay=0.3),
        },
        check=check,
    )
    begun = time.monotonic()
    probes.start(begun)
    try:
        deadline = time.monotonic() + 5
        while not any(k == "livenessProbe" for k, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.02)
        first = next(t for k, t in seen if k == "livenessProbe")
        assert first - begun >= 0.3  # initialDelaySeconds, counted from the start
        assert probes.started
        answers["code"] = 503
        while probes.kill is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert probes.kill is not None
    finally:
        probes.stop()
