"""A loopback OTLP/HTTP trace receiver for tests: it stores each export request and
decodes them from protobuf (`opentelemetry-proto`, what a collector would parse)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_receiver() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def received_spans(server: ThreadingHTTPServer) -> tuple[list, list[dict[str, str]]]:
    """Every span the receiver got (protobuf Span messages), and each resource's string
    attributes."""
    spans, resources = [], []
    for _, body in server.bodies:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            attributes = resource_spans.resource.attributes
            resources.append({a.key: a.value.string_value for a in attributes})
            spans += [s for scope in resource_spans.scope_spans for s in scope.spans]
    return spans, resources


def attributes(span) -> dict:
    """A protobuf span's attributes as plain values."""
    out = {}
    for item in span.attributes:
        value = item.value
        out[item.key] = getattr(value, value.WhichOneof("value"))
    return out
