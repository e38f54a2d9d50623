"""The HTTP endpoint over real sockets: /metrics, /status (the operator's contract),
/healthz; concurrent updates; clean shutdown; the Telemetry hub as the guard's listener."""

from __future__ import annotations

import json
import math
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlft.trainer.config.telemetry import TelemetrySpec
from rlft.trainer.stability.actions import StepGuard
from rlft.trainer.telemetry.hub import Telemetry
from rlft.trainer.telemetry.status import StatusBoard

STATUS_KEYS = {
    "step", "policyVersion", "reward", "phase", "health", "lastCheckpoint", "lastHealthyCheckpoint",
    "rollbacks", "skippedUpdates", "events", "podUid",
}  # fmt: skip


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read()


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    hub = Telemetry.start(TelemetrySpec(max_events=5))
    yield hub
    hub.close()


def test_endpoints(telemetry: Telemetry):
    assert telemetry.server.host == "127.0.0.1" and telemetry.server.port > 0
    telemetry.record({"step": 3, "policy_version": 3, "grad_norm": 1.25, "reward_mean": 0.5})
    code, kind, body = get(telemetry.url + "/metrics")
    assert code == 200 and kind.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["rlft_grad_norm"].samples[0].value == 1.25
    code, kind, body = get(telemetry.url + "/status")
    status = json.loads(body)
    assert code == 200 and kind == "application/json"
    assert set(status) == STATUS_KEYS
    assert (status["step"], status["policyVersion"], status["health"]) == (3, 3, "ok")
    assert status["reward"] == 0.5  # the operator mirrors it into the RLFineTune's status
    assert status["lastCheckpoint"] is None and status["events"] == []
    assert status["podUid"] is None  # not in a pod (no $RLFT_POD_UID)
    assert get(telemetry.url + "/healthz")[:1] == (200,)
    assert get(telemetry.url + "/nope")[0] == 404


def test_status_follows_guard_decisions_and_checkpoints(telemetry: Telemetry):
    guard = StepGuard(listener=telemetry)
    telemetry.set_phase("training")
    for step in range(1, 31):
        record = {"step": step, "policy_version": step, "grad_norm": 1.0 + 0.01 * (step % 3)}
        guard.check(record)
        telemetry.record(record)
    telemetry.checkpoint(30, "file:///tmp/ck/step-000030", healthy=True, when=0.0)
    spike = {"step": 31, "policy_version": 31, "grad_norm": 100.0}
    assert guard.check(spike).action == "skip"
    telemetry.record(spike)
    telemetry.checkpoint(31, "file:///tmp/ck/step-000031", healthy=False, when=60.0)
    status = json.loads(get(telemetry.url + "/status")[2])
    assert status["phase"] == "training" and status["health"] == "warning"
    assert status["skippedUpdates"] == 1 and status["rollbacks"] == 0
    assert status["lastCheckpoint"] == {
        "step": 31, "uri": "file:///tmp/ck/step-000031", "time": "1970-01-01T00:01:00Z"
    }  # fmt: skip
    assert status["lastHealthyCheckpoint"]["step"] == 30
    kinds = [e["kind"] for e in status["events"]]
    assert kinds == ["checkpoint", "skip", "checkpoint"]
    skip = status["events"][1]
    assert skip["step"] == 31 and skip["level"] == "warning" and "grad norm" in skip["message"]
    metrics = get(telemetry.url + "/metrics")[2].decode()
    assert "rlft_skipped_updates_total 1.0" in metrics


def test_events_are_bounded_and_newest_kept():
    board = StatusBoard(max_events=3)
    for i in range(10):
        board.event("e", f"event {i}", step=i)
    assert [e["message"] for e in board.snapshot()["events"]] == ["event 7", "event 8", "event 9"]
    with pytest.raises(ValueError, match="phase"):
        board.set_phase("dancing")
    with pytest.raises(ValueError, match="health"):
        board.set_health("great")


def test_concurrent_updates_and_reads(telemetry: Telemetry):
    errors: list[Exception] = []

    def write():
        try:
            for step in range(1, 400):
                telemetry.record({"step": step, "grad_norm": step * 0.5, "tokens": 1})
                telemetry.event("e", f"step {step}")
        except Exception as error:  # pragma: no cover (reported below)
            errors.append(error)

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    while writer.is_alive() or reads < 5:
        status = json.loads(get(telemetry.url + "/status")[2])
        assert len(status["events"]) <= 5
        text = get(telemetry.url + "/metrics")[2].decode()
        assert "rlft_train_step" in text
        reads += 1
    writer.join()
    assert not errors
    status = json.loads(get(telemetry.url + "/status")[2])
    assert status["step"] == 399
    tokens = {
        f.name: f
        for f in text_string_to_metric_families(get(telemetry.url + "/metrics")[2].decode())
    }
    assert tokens["rlft_trained_tokens"].samples[0].value == 399


def test_close_releases_the_port():
    hub = Telemetry.start(TelemetrySpec())
    port = hub.server.port
    hub.close()
    hub.close()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with socket.socket() as again:  # the port is free to bind again
        again.bind(("127.0.0.1", port))


def test_disabled_telemetry_serves_nothing_but_still_records():
    hub = Telemetry.start(TelemetrySpec(enabled=False))
    try:
        assert hub.server is None and hub.url is None
        hub.record({"step": 2, "loss": math.nan})
        assert hub.board.snapshot()["step"] == 2
    finally:
        hub.close()


def test_non_apply_decisions_are_logged():
    lines: list[str] = []
    hub = Telemetry.start(TelemetrySpec(enabled=False), log=lines.append)
    guard = StepGuard(listener=hub)
    guard.check({"step": 1, "loss": math.nan})
    hub.close()
    assert len(lines) == 1 and "skip" in lines[0] and "non-finite values in loss" in lines[0]
