"""The rollout API's token on real servers: an instance started with one answers
POST /generate and POST /weights only to a caller that sends it, and its probes and
metrics stay open. In process (start_server) and as the subprocess `rlft train` starts
(LocalServers: the token travels in the environment)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rollout_fixtures import PROMPTS, ThreadServer, publish, store_at, tiny_model

from rlft.trainer.api_token import TOKEN_ENV
from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout.client import RequestFailed, RolloutClient, http_json
from rlft.trainer.rollout.local import LocalServers
from rlft.trainer.rollout.protocol import GenerateRequest, WeightsRequest
from rlft.trainer.rollout.server import open_api_warning

TOKEN = "s3cr3t-token-for-this-test"


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST, whatever the status."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


@pytest.fixture
def guarded():
    instance = ThreadServer(token=TOKEN)
    yield instance
    instance.stop()


def test_an_instance_with_a_token_refuses_posts_without_it(guarded, tmp_path: Path) -> None:
    model = tiny_model()[0]
    uri = publish(store_at(tmp_path), model, 4)
    load = json.dumps({"version": 4, "uri": uri}).encode()

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, body, answer_headers = post(f"{guarded.url}/weights", load, headers)
        assert status == 401, headers
        assert TOKEN_ENV in body["error"] and TOKEN not in body["error"]
        assert answer_headers["WWW-Authenticate"] == "Bearer"
    # The probes stay open, and a refused load changed nothing: still no weights.
    assert http_json(f"{guarded.url}/livez", None, 5)["ok"]
    with pytest.raises(urllib.error.HTTPError) as unready:
        urllib.request.urlopen(f"{guarded.url}/healthz", timeout=5)
    assert unready.value.code == 503


def test_a_refused_large_request_still_gets_its_answer(guarded) -> None:
    """The 401 comes after the body is read: replying first would reset a connection
    still sending, and the caller would see a broken pipe, not the reason."""
    big = json.dumps({"prompts": [[1] * 1000] * 2000, "n": 1}).encode()  # about 6 MB
    assert len(big) > 4 << 20
    status, body, _ = post(f"{guarded.url}/generate", big, {"Content-Type": "application/json"})
    assert status == 401 and TOKEN_ENV in body["error"]


def test_the_client_with_the_token_loads_and_generates(guarded, tmp_path: Path) -> None:
    model = tiny_model()[0]
    uri = publish(store_at(tmp_path), model, 2)
    stranger = RolloutClient([guarded.url], timeout_s=10, token="another-jobs-token")
    try:
        refused = f"HTTP 401 refused this client's rollout token \\({TOKEN_ENV}\\)"
        with pytest.raises(RequestFailed, match=refused):
            http_json(f"{guarded.url}/weights", {"version": 2, "uri": uri}, 10, stranger.token)
    finally:
        stranger.close()

    client = RolloutClient([guarded.url], timeout_s=60, token=TOKEN)
    try:
        assert client.load_weights(client.instances[0], WeightsRequest(version=2, uri=uri), 60)
        greedy = SamplingParams(max_new_tokens=4, greedy=True)
        answer = client.generate(GenerateRequest(PROMPTS, 1, greedy, seed=0))
        assert answer.policy_version == 2 and len(answer.completions) == len(PROMPTS)
    finally:
        client.close()
    with urllib.request.urlopen(f"{guarded.url}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert 'rlft_rollout_requests_total{status="unauthorized"} 1.0' in metrics
    assert 'rlft_rollout_requests_total{status="ok"} 1.0' in metrics


def test_a_token_read_with_its_newline_works_and_a_bad_one_is_never_quoted(
    guarded, tmp_path: Path, monkeypatch
) -> None:
    """A token Secret made with `kubectl create secret --from-file` ends in a newline:
    http.client refused the header and its error, quoting `Bearer <token>`, reached the
    trainer's log, its verdict and the job's status. The newline is dropped; a token that
    cannot be a header is refused naming the variable, not its value."""
    uri = publish(store_at(tmp_path), tiny_model()[0], 5)
    monkeypatch.setenv(TOKEN_ENV, TOKEN + "\n")
    client = RolloutClient([guarded.url], timeout_s=60)
    try:
        assert client.load_weights(client.instances[0], WeightsRequest(version=5, uri=uri), 60)
    finally:
        client.close()
    monkeypatch.setenv(TOKEN_ENV, "s3cr3t token\nwith-breaks")
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} holds characters") as refused:
        RolloutClient([guarded.url], timeout_s=60)
    assert "s3cr3t" not in str(refused.value)


def test_a_server_given_no_token_takes_a_client_that_sends_one(tmp_path: Path) -> None:
    """An upgrade's mix: trainers a new operator restarted send the job's token to a
    rollout pod made before tokens (or for trainers that had none), which serves them."""
    open_server = ThreadServer()
    client = RolloutClient([open_server.url], timeout_s=60, token=TOKEN)
    try:
        uri = publish(store_at(tmp_path), tiny_model()[0], 3)
        assert client.load_weights(client.instances[0], WeightsRequest(version=3, uri=uri), 60)
        greedy = SamplingParams(max_new_tokens=4, greedy=True)
        assert client.generate(GenerateRequest(PROMPTS, 1, greedy, seed=0)).policy_version == 3
    finally:
        client.close()
        open_server.stop()


def test_local_servers_take_only_the_runs_token(tmp_path: Path, monkeypatch) -> None:
    """`rlft train`'s servers are subprocesses: the token drawn for the run reaches them
    through their environment, and a caller without it is refused."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    model = tiny_model()[0]
    store = store_at(tmp_path)
    publish(store, model, 0)
    with LocalServers(1, "transformers", store.storage.uri, log_dir=tmp_path) as servers:
        assert len(servers.token) >= 32
        [url] = servers.start()
        body = GenerateRequest(PROMPTS, 1, SamplingParams(max_new_tokens=2), seed=0).to_json()
        with pytest.raises(RequestFailed, match="HTTP 401"):
            http_json(f"{url}/generate", body, 30)
        answer = http_json(f"{url}/generate", body, 30, servers.token)
        assert answer["policy_version"] == 0
        log = (tmp_path / "rollout-0.log").read_text()
    assert servers.token not in log


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [
        ("::", None, True),  # what the operator renders, were the token not given
        ("0.0.0.0", None, True),
        ("10.1.2.3", None, True),
        ("127.0.0.1", None, False),  # `rlft rollout`'s default
        ("::1", None, False),
        ("::", TOKEN, False),
    ],
)
def test_rlft_rollout_warns_when_it_takes_any_caller_from_elsewhere(host, token, warned):
    warning = open_api_warning(host, token)
    assert (warning is not None) is warned
    if warned:
        assert TOKEN_ENV in warning and host in warning
