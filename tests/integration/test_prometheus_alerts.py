"""A real Prometheus scrapes a real TelemetryServer while a driver plays a training
loop's records through the StepGuard; a gradient spike is injected. The generated
RLFTGradientSpike alert must reach `firing`, and the guard must have skipped the update.

The loop is emulated (records only, no model); the variant with the real training loop
belongs with the loop itself.
"""

from __future__ import annotations

import json
import math
import random
import time
import urllib.request
from pathlib import Path

from prometheus_fixtures import prometheus  # noqa: F401 (fixture)

from rlft.trainer.config.telemetry import TelemetrySpec
from rlft.trainer.stability.actions import StepGuard
from rlft.trainer.telemetry.generate import RULES
from rlft.trainer.telemetry.hub import Telemetry

REPO = Path(__file__).resolve().parents[2]


def record(step: int, rng: random.Random, spike: float = 1.0) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "loss": rng.gauss(0, 0.003),
        "grad_norm": spike * math.exp(rng.gauss(0.3, 0.25)),
        "entropy": 0.3 * math.exp(rng.gauss(0, 0.1)),
        "reward_mean": 0.5 + rng.gauss(0, 0.05),
        "tokens": 900,
        "step_time_s": 0.05,
    }


def firing(alerts: list[dict], name: str) -> list[dict]:
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_gradient_spike_alert_fires_and_update_is_skipped(prometheus):  # noqa: F811
    rng = random.Random(0)
    telemetry = Telemetry.start(TelemetrySpec())
    try:
        guard = StepGuard(listener=telemetry)
        target = f"127.0.0.1:{telemetry.server.port}"
        server = prometheus([target], [REPO / RULES])
        telemetry.set_phase("training")

        def train_step(step: int, spike: float = 1.0) -> str:
            rec = record(step, rng, spike)
            decision = guard.check(rec)  # before optimizer.step()
            telemetry.record(rec)
            return decision.action

        step = 0
        for step in range(1, 26):  # past the detector's warm-up
            assert train_step(step) == "apply"
        server.wait_for(
            "a scrape of the healthy steps",
            lambda: any(float(r["value"][1]) >= 25 for r in server.query("rlft_train_step")),
        )
        assert not firing(server.alerts(), "RLFTGradientSpike")

        step += 1
        assert train_step(step, spike=50.0) == "skip"
        deadline = time.monotonic() + 30
        while not firing(server.alerts(), "RLFTGradientSpike"):
            assert time.monotonic() < deadline, "RLFTGradientSpike never fired"
            step += 1
            assert train_step(step) == "apply"  # the run goes on after the skip
            time.sleep(0.2)

        [alert] = firing(server.alerts(), "RLFTGradientSpike")
        assert alert["labels"]["instance"] == target
        assert alert["labels"]["severity"] == "warning"
        assert not firing(server.alerts(), "RLFTCollapsed")
        skipped = server.query("rlft_skipped_updates_total")
        assert [float(r["value"][1]) for r in skipped] == [1.0]
        with urllib.request.urlopen(telemetry.url + "/status", timeout=5) as response:
            status = json.loads(response.read())
        assert status["skippedUpdates"] == 1 and status["step"] == step
        assert status["events"][0]["kind"] == "skip"
    finally:
        telemetry.close()
