"""Telemetry of the trainer: metric definitions, Prometheus exporter, /status, tracing.

Import the submodules you need; `metrics` has no dependencies (the operator, the alert
rules and the dashboard generator import it), the others need prometheus-client and
opentelemetry.
"""
