"""`spec.telemetry`: where the trainer serves /metrics and /status, and where traces go.

No torch import: the operator reads this section to know which port to scrape and poll.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from rlft.trainer.config.base import Section, checked
from rlft.trainer.config.locations import holds_credentials


class TelemetrySpec(Section):
    """Metrics, status and tracing of the trainer (rank 0)."""

    enabled: bool = True
    """Serve /metrics, /status and /healthz over HTTP."""
    host: str = Field("127.0.0.1", min_length=1, max_length=253)
    """Address to bind (an IPv4 or IPv6 address). Locally loopback; the operator renders
    `::` into pods, every address of the pod, IPv6 and IPv4, so that Prometheus and the
    operator reach it on IPv4, IPv6 and dual-stack clusters."""
    port: int = Field(0, ge=0, le=65535)
    """Port to serve on; 0 picks a free one (printed at start). The operator sets a fixed
    port in pods."""
    max_events: int = Field(50, ge=1, le=10_000)
    """Recent events kept in /status."""
    expert_load_every_steps: int = Field(50, ge=1, le=1_000_000)
    """Steps between the lines of metrics.jsonl that carry an MoE model's whole load
    matrix (`expert_load`: each expert's share of its layer's tokens), and the first
    step's line. Every line has the per-layer imbalance and the worst layer's figures
    (what the stability guard judges); the matrix of a 48-layer model with 128 experts
    is about 135 KB, every step a weeks-long run's file and checkpoint history would
    carry."""
    otlp_endpoint: str | None = Field(None, min_length=1, max_length=2048)
    """OTLP/HTTP collector for step traces, e.g. `http://otel-collector:4318`. Unset: the
    standard OTEL_EXPORTER_OTLP_ENDPOINT variable is used if set, else no tracing. No
    credentials in it (the job file is a ConfigMap): give a collector's auth header by
    OTEL_EXPORTER_OTLP_HEADERS from a Secret (spec.trainer.env valueFrom)."""
    service_name: str = Field("rlft-trainer", min_length=1, max_length=253)
    """`service.name` of the exported spans."""

    @field_validator("otlp_endpoint", mode="before")
    @classmethod
    def _no_credentials(cls, url: Any) -> Any:
        return checked(url, _otlp_problem) if isinstance(url, str) else url


def _otlp_problem(url: str) -> str | None:
    if holds_credentials(url) or "?" in url or "#" in url:
        return (
            "must hold no credentials, query or fragment (the job file is a ConfigMap): "
            "give the collector's auth header by OTEL_EXPORTER_OTLP_HEADERS from a Secret"
        )
    return None
