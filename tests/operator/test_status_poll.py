"""The operator's /status poller against a real trainer telemetry server: both sides of
the contract (trainer/telemetry/status.py → operator/handlers.poll_trainer)."""

from __future__ import annotations

import asyncio

import pytest
from pods import view

from rlft.operator.handlers import poll_trainer
from rlft.trainer.addresses import ALL
from rlft.trainer.config.telemetry import TelemetrySpec
from rlft.trainer.telemetry.hub import Telemetry
from rlft.trainer.telemetry.status import POD_UID_ENV


def test_the_poller_mirrors_its_own_pods_status_and_drops_another_pods(monkeypatch):
    """Pod addresses are reused: a new pod can get the address of an old pod still
    serving /status on it (the test cluster's loopback addresses do this; a real node can
    after a pod's IP is freed). The trainer says which pod it is; the poller believes only
    the pod it asked, so a job never shows another job's step or checkpoint."""
    monkeypatch.setenv(POD_UID_ENV, "uid-of-the-serving-pod")
    telemetry = Telemetry.start(TelemetrySpec())
    try:
        telemetry.record({"step": 7, "policy_version": 7, "reward_mean": 0.25})
        telemetry.checkpoint(5, "s3://other-job/run/step-000005", healthy=True)
        port, ip = telemetry.server.port, telemetry.server.host

        def poll(uid: str):
            pod = view("job-trainer-0", phase="Running", pod_ip=ip, uid=uid)
            return asyncio.run(poll_trainer([pod], port))

        mine = poll("uid-of-the-serving-pod")
        assert mine is not None and mine.step == 7 and mine.pod_uid == "uid-of-the-serving-pod"
        assert mine.last_checkpoint["uri"] == "s3://other-job/run/step-000005"
        assert poll("uid-of-a-new-pod-at-that-address") is None
    finally:
        telemetry.close()


@pytest.mark.parametrize("pod_ip", ["127.0.0.1", "::1"])
def test_the_poller_reaches_a_trainer_on_every_address_as_the_operator_renders_it(
    monkeypatch, pod_ip
):
    """The pods' telemetry binds every address (the operator renders `::`): the poller
    reaches it at an IPv4 pod address and at an IPv6 one (an IPv6-only cluster), whose
    URL needs brackets (it was `http://::1:PORT/status`, which no client can open)."""
    monkeypatch.setenv(POD_UID_ENV, "uid-0")
    telemetry = Telemetry.start(TelemetrySpec(host=ALL))
    try:
        telemetry.record({"step": 3, "policy_version": 3, "reward_mean": 0.5})
        pod = view("job-trainer-0", phase="Running", pod_ip=pod_ip, uid="uid-0")
        report = asyncio.run(poll_trainer([pod], telemetry.server.port))
        assert report is not None and report.step == 3
    finally:
        telemetry.close()
