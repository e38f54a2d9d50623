"""The trainer's and rollout pods' HTTP servers on IPv4, IPv6 and dual-stack networks,
with real sockets on this machine's loopback addresses (127.0.0.1 and ::1)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler

import pytest

from rlft.trainer.addresses import ALL, http_url, is_loopback
from rlft.trainer.http_server import HTTPServer


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"path": self.path}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _get(host: str, port: int, path: str = "/hello") -> dict:
    with urllib.request.urlopen(http_url(host, port, path), timeout=5) as reply:
        return json.loads(reply.read())


def _serving(host: str) -> HTTPServer:
    server = HTTPServer((host, 0), _Hello)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}).start()
    return server


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8080/status"),
        ("fd00:10:244::5", "http://[fd00:10:244::5]:8080/status"),
        ("[::1]", "http://[::1]:8080/status"),
        ("trainer-0.job.ml.svc", "http://trainer-0.job.ml.svc:8080/status"),
    ],
)
def test_an_ipv6_literal_is_bracketed_in_a_url(host, url):
    assert http_url(host, 8080, "/status") == url


def test_every_address_takes_ipv4_and_ipv6_connections():
    """What the operator renders into its pods: one socket for a pod's IPv4 and IPv6
    addresses (IPV6_V6ONLY off, whatever the node's default)."""
    server = _serving(ALL)
    try:
        port = server.server_address[1]
        assert server.socket.family == socket.AF_INET6
        assert _get("127.0.0.1", port) == {"path": "/hello"}
        assert _get("::1", port) == {"path": "/hello"}
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("host", "other"), [("::1", "127.0.0.1"), ("127.0.0.1", "::1")])
def test_a_single_address_is_served_on_that_family_alone(host, other):
    server = _serving(host)
    try:
        port = server.server_address[1]
        assert _get(host, port) == {"path": "/hello"}
        with pytest.raises(OSError):
            _get(other, port)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.5.0.9", True),  # the whole 127/8, as the test cluster's pods have
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("fd00::5", False),
        ("rollout-0.job-rollout.ml.svc", False),  # a name may resolve to any interface
    ],
)
def test_only_loopback_addresses_count_as_loopback(host, loopback):
    assert is_loopback(host) is loopback
