"""The operator's own API calls follow rotated credentials: a projected service-account
token expires (hourly where the API server does not extend it) and the kubelet writes a
new one; the client kept the token it logged in with, so every write failed 401 from
then on. Against a real HTTP server on loopback that accepts only the current token."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlft.operator.kube import ApiError, Connection, Kube, job_path


class TokenServer:
    """Answers GET on any path with {} for the token in `token_file`, else 401."""

    def __init__(self, token_file: Path):
        self.seen: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                given = self.headers.get("Authorization", "")
                server.seen.append(given)
                ok = given == f"Bearer {token_file.read_text()}"
                body = json.dumps({} if ok else {"message": "Unauthorized"}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text("first")
    return path


@pytest.fixture
def api(token_file):
    server = TokenServer(token_file)
    yield server
    server.stop()


def _connection(url: str, token_file: Path) -> Connection:
    return Connection(server=url, headers={"Authorization": f"Bearer {token_file.read_text()}"})


def test_a_401_re_reads_the_credentials_and_tries_once_more(api, token_file):
    async def calls() -> None:
        kube = Kube(
            _connection(api.url, token_file), relogin=lambda: _connection(api.url, token_file)
        )
        try:
            assert await kube.get_job("ml", "job") == {}
            token_file.write_text("rotated")  # the kubelet's new token
            assert await kube.get_job("ml", "job") == {}
        finally:
            await kube.close()

    asyncio.run(calls())
    assert api.seen == ["Bearer first", "Bearer first", "Bearer rotated"]


def test_without_fresh_credentials_the_401_is_an_api_error(api, token_file):
    async def calls() -> None:
        kube = Kube(
            _connection(api.url, token_file), relogin=lambda: _connection(api.url, token_file)
        )
        try:
            token_file.write_text("rotated")
            stale = Kube(_connection(api.url, token_file))
            token_file.write_text("again")
            with pytest.raises(ApiError) as raised:
                await stale.get_job("ml", "job")
            await stale.close()
            assert raised.value.status == 401
            kube.reconnect(_connection(api.url, token_file))  # what kopf's re-login does
            assert await kube.get_job("ml", "job") == {}
        finally:
            await kube.close()

    asyncio.run(calls())
    assert api.seen[-1] == "Bearer again"
    assert job_path("ml", "job").endswith("/namespaces/ml/rlfinetunes/job")


def test_an_api_server_out_of_reach_is_an_api_error_not_a_bug():
    """Nothing listens where the API server should be: the connection error escaped as
    itself, and the reconcile loop took it for a bug of the operator (a traceback every
    poll, counted as `error`, no retry of its own); it is the server's trouble, a 503."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there

    async def call() -> None:
        kube = Kube(Connection(server=f"http://127.0.0.1:{port}", headers={}), timeout=5)
        try:
            await kube.get_job("ml", "job")
        finally:
            await kube.close()

    with pytest.raises(ApiError) as refused:
        asyncio.run(call())
    assert refused.value.status == 503 and "no answer from the API server" in str(refused.value)


def test_a_garbled_answer_is_reported_without_the_requests_credentials():
    """A proxy that answers with a malformed response: aiohttp's error carries the
    request's headers, and its repr, put into the ApiError the operator logs, quoted the
    service account's bearer token."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def garble() -> None:
        with contextlib.suppress(OSError):
            peer, _ = listener.accept()
            with peer:
                peer.recv(65536)
                peer.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n")

    thread = threading.Thread(target=garble, daemon=True)
    thread.start()
    secret = "Bearer SECRET-sa-token-0123"

    async def call() -> None:
        server = f"http://127.0.0.1:{listener.getsockname()[1]}"
        kube = Kube(Connection(server=server, headers={"Authorization": secret}), timeout=5)
        try:
            await kube.get_job("ml", "job")
        finally:
            await kube.close()

    try:
        with pytest.raises(ApiError) as garbled:
            asyncio.run(call())
    finally:
        listener.close()
        thread.join(timeout=5)
    assert garbled.value.status == 503 and "no answer from the API server" in str(garbled.value)
    assert "SECRET-sa-token" not in str(garbled.value)
