"""OpenTelemetry spans for each step and its phases, or nothing at all.

    tracer = StepTracer.from_config(spec.telemetry.otlp_endpoint)
    with tracer.step(step, policy_version):
        tracer.record("generate", start_ns, end_ns)   # a phase that ran elsewhere
        with tracer.phase("train"): ...

Spans are exported over OTLP/HTTP only when an endpoint is configured (the job's
`spec.telemetry.otlpEndpoint`, else the standard `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` environment variables). Without one, `step()` and
`phase()` return a shared do-nothing context manager: no SDK objects, no clock reads, so
an untraced loop pays well under a microsecond per phase.

The tracer uses its own TracerProvider, never the global one, so it cannot interfere
with tracing set up by the user's reward code or by libraries.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from rlft.trainer.telemetry.metrics import PHASES

_ENV_KEYS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class _Nothing:
    """A reusable no-op context manager (cheaper than creating one per call)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NOTHING = _Nothing()


def endpoint_from(config_endpoint: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The OTLP endpoint to use: the job's setting, else the standard environment."""
    if config_endpoint:
        return config_endpoint
    environ = os.environ if environ is None else environ
    for key in _ENV_KEYS:
        if environ.get(key):
            return environ[key]
    return None


def _traces_url(endpoint: str) -> str:
    """OTLP/HTTP wants the full traces path; accept a bare collector address too."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class StepTracer:
    """Spans `step` → `generate`, `score`, `train`, `publish_weights`, `checkpoint`."""

    def __init__(
        self, span_exporter: Any = None, service_name: str = "rlft-trainer", batch: bool = True
    ):
        """`span_exporter` None makes a tracer that does nothing. Tests pass an
        InMemorySpanExporter with `batch=False` to see spans synchronously."""
        self._provider = None
        self._tracer = None
        if span_exporter is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor if batch else SimpleSpanProcessor
        self._provider.add_span_processor(processor(span_exporter))
        self._tracer = self._provider.get_tracer("rlft.trainer")

    @classmethod
    def from_config(
        cls, otlp_endpoint: str | None = None, service_name: str = "rlft-trainer"
    ) -> StepTracer:
        """OTLP/HTTP export when an endpoint is configured, else a no-op tracer."""
        endpoint = endpoint_from(otlp_endpoint)
        if endpoint is None:
            return cls()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=_traces_url(endpoint)), service_name)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def step(self, step: int, policy_version: int | None = None, stage: str | None = None):
        """Context manager: the span of one training step (parent of its phases);
        `stage` names the phase of the job (the warm start, the algorithm)."""
        if self._tracer is None:
            return _NOTHING
        attributes = {"rlft.step": step, "rlft.policy_version": policy_version, "rlft.stage": stage}
        return self._span("step", attributes)

    def phase(self, name: str, **attributes: Any):
        """Context manager: the span of one phase of the current step."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}: use one of {PHASES}")
        if self._tracer is None:
            return _NOTHING
        return self._span(name, {f"rlft.{k}": v for k, v in attributes.items()})

    def record(self, name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
        """A finished phase of the current step, with its own start and end (`time.time_ns`):
        generation and scoring that ran on the rollout pipeline's thread."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}: use one of {PHASES}")
        if self._tracer is None:
            return
        clean = {f"rlft.{k}": v for k, v in attributes.items() if v is not None}
        span = self._tracer.start_span(name, attributes=clean, start_time=start_ns)
        span.end(end_time=end_ns)

    @contextlib.contextmanager
    def _span(self, name: str, attributes: dict[str, Any]) -> Iterator[None]:
        clean = {k: v for k, v in attributes.items() if v is not None}
        with self._tracer.start_as_current_span(name, attributes=clean):
            yield

    def close(self) -> None:
        """Flush pending spans and stop the exporter (idempotent)."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None
