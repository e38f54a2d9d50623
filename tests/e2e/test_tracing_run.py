"""A real job with `spec.telemetry.otlpEndpoint` set exports its step spans over
OTLP/HTTP: one span per step with the policy version, and a child per phase."""

from __future__ import annotations

from collections import Counter

import pytest
from otlp_receiver import attributes, received_spans
from tiny_jobs import arithmetic_rl_spec, write_parity_job

from rlft.trainer.config import load_job
from rlft.trainer.run.job import run_job

RL_PHASES = {"generate", "score", "train", "publish_weights", "checkpoint"}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_job_exports_one_step_span_per_step_with_its_phases(tmp_path, monkeypatch, otlp_receiver):
    port = otlp_receiver.server_address[1]
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=4)
    spec["telemetry"] = {"otlpEndpoint": f"http://127.0.0.1:{port}", "serviceName": "rlft-e2e"}
    spec["checkpoint"] = {"intervalSteps": 2}
    monkeypatch.syspath_prepend(str(tmp_path))
    job = load_job(write_parity_job(tmp_path, spec))

    summary = run_job(job, tmp_path / "out")
    assert summary["steps"] == 4

    spans, resources = received_spans(otlp_receiver)
    assert {r["service.name"] for r in resources} == {"rlft-e2e"}
    steps = [s for s in spans if s.name == "step"]
    by_stage = Counter(attributes(s)["rlft.stage"] for s in steps)
    assert by_stage == {"SFT warm start": summary["sft_steps"], "GRPO": 4}
    rl_steps = sorted(
        (s for s in steps if attributes(s)["rlft.stage"] == "GRPO"),
        key=lambda s: attributes(s)["rlft.step"],
    )
    assert [attributes(s)["rlft.step"] for s in rl_steps] == [1, 2, 3, 4]
    # The version a step starts from: one more per applied update.
    versions = [attributes(s)["rlft.policy_version"] for s in rl_steps]
    assert versions == sorted(versions) and versions[0] == 0
    for step in rl_steps:
        children = [s for s in spans if s.parent_span_id == step.span_id]
        assert {c.trace_id for c in children} == {step.trace_id}
        assert {c.name for c in children} == RL_PHASES, attributes(step)
        for child in children:
            assert child.end_time_unix_nano >= child.start_time_unix_nano
    warm = next(s for s in steps if attributes(s)["rlft.stage"] == "SFT warm start")
    assert {c.name for c in spans if c.parent_span_id == warm.span_id} == {
        "train",
        "publish_weights",
    }
