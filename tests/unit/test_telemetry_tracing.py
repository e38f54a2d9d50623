"""Step tracing: span tree in memory, real OTLP/HTTP export to a loopback receiver, and
a no-op that costs next to nothing when tracing is not configured."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otlp_receiver import received_spans

from rlft.trainer.telemetry.metrics import PHASES
from rlft.trainer.telemetry.tracing import StepTracer, endpoint_from


def test_spans_of_a_step_and_its_phases():
    exporter = InMemorySpanExporter()
    tracer = StepTracer(exporter, batch=False)
    for step in (1, 2):
        with tracer.step(step, policy_version=step - 1):
            for phase in PHASES:
                with tracer.phase(phase, samples=8):
                    pass
    tracer.close()
    spans = exporter.get_finished_spans()
    steps = [s for s in spans if s.name == "step"]
    assert [s.attributes["rlft.step"] for s in steps] == [1, 2]
    assert steps[0].attributes["rlft.policy_version"] == 0
    children = [s for s in spans if s.parent and s.parent.span_id == steps[0].context.span_id]
    assert [s.name for s in children] == list(PHASES)
    assert children[0].attributes["rlft.samples"] == 8
    assert children[0].resource.attributes["service.name"] == "rlft-trainer"


def test_exception_is_recorded_and_propagates():
    exporter = InMemorySpanExporter()
    tracer = StepTracer(exporter, batch=False)
    with pytest.raises(RuntimeError), tracer.phase("train"):
        raise RuntimeError("boom")
    [span] = exporter.get_finished_spans()
    assert not span.status.is_ok and span.events[0].name == "exception"


def test_untraced_tracer_is_a_cheap_no_op():
    tracer = StepTracer()
    assert not tracer.enabled
    calls = 100_000
    started = time.perf_counter()
    for _ in range(calls):
        with tracer.phase("generate"):
            pass
    per_call = (time.perf_counter() - started) / calls
    assert per_call < 5e-6, f"no-op phase() costs {per_call * 1e6:.2f} µs"
    with pytest.raises(ValueError, match="unknown phase"):
        tracer.phase("lunch")


def test_endpoint_resolution():
    assert endpoint_from("http://a:4318", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b"}) == (
        "http://a:4318"
    )
    assert endpoint_from(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318"}) == "http://b:4318"
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/v1/traces",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b"}  # fmt: skip
    assert endpoint_from(None, env) == "http://t/v1/traces"
    assert endpoint_from(None, {}) is None


def test_otlp_http_export_to_a_collector(otlp_receiver, monkeypatch):
    port = otlp_receiver.server_address[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    tracer = StepTracer.from_config(None, service_name="rlft-test")
    assert tracer.enabled
    with tracer.step(5), tracer.phase("publish_weights"):
        pass
    tracer.close()  # flushes the batch
    assert otlp_receiver.bodies, "no OTLP request reached the receiver"
    assert otlp_receiver.bodies[0][0] == "/v1/traces"
    spans, resources = received_spans(otlp_receiver)
    assert {s.name for s in spans} == {"step", "publish_weights"}
    assert resources[0]["service.name"] == "rlft-test"
