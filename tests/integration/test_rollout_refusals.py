"""What a rollout server refuses without counting it against its engine, on real servers
over loopback HTTP: requests whose own content fails them (answered 400, sent to no other
instance, /livez still ok), loads whose weights cannot be read (the served weights stay
served), and connections that send nothing (dropped after the handler's timeout) or
announce no usable length."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rollout_fixtures import PROMPTS, ThreadServer, publish, store_at, tiny_model

from rlft.trainer.config import JobFileError, parse_job
from rlft.trainer.config.rollout import MIN_TEMPERATURE
from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout.client import RolloutClient, http_json
from rlft.trainer.rollout.protocol import GenerateRequest, ProtocolError, WeightsRequest
from rlft.trainer.rollout.server import ENGINE_FAILURES

GREEDY = SamplingParams(max_new_tokens=4, greedy=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[list[ThreadServer], RolloutClient]]:
    """Two servers serving version 1 of the tiny model (64 positions), and a client."""
    servers = [ThreadServer(), ThreadServer()]
    client = RolloutClient([s.url for s in servers], timeout_s=30, deadline_s=3, probe_every_s=0.1)
    try:
        uri = publish(store_at(tmp_path), tiny_model()[0], 1)
        for server in servers:
            http_json(f"{server.url}/weights", {"version": 1, "uri": uri}, 60)
        yield servers, client
    finally:
        client.close()
        for server in servers:
            server.stop()


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def assert_refused_and_no_engine_failure(
    servers: list[ThreadServer], client: RolloutClient, request: GenerateRequest, cause: str
) -> None:
    """The request fails at once naming `cause`, was sent to one instance only, and no
    instance counts it: each stays alive, healthy, and takes the next request."""
    with pytest.raises(ProtocolError, match=cause):
        client.generate(request)
    assert client.reissued == 0
    for server in servers:
        assert server.server.host.failed_in_a_row == 0
        assert status_of(f"{server.url}/livez") == 200
    assert all(i.healthy for i in client.instances)
    assert client.generate(GenerateRequest(PROMPTS, 1, GREEDY)).policy_version == 1


def test_a_temperature_that_overflows_the_logits_is_refused_not_an_engine_failure(pair) -> None:
    """temperature 1e-40 passed the protocol's (0, 10]: logits / T overflowed to NaN
    probabilities, the engine failed it on every instance it was re-sent to, and after
    ENGINE_FAILURES of them every instance's /livez said 503 (all pods restarted)."""
    servers, client = pair
    tiny = SamplingParams(temperature=1e-40, max_new_tokens=4)
    for _ in range(ENGINE_FAILURES):
        assert_refused_and_no_engine_failure(
            servers,
            client,
            GenerateRequest(PROMPTS, 2, tiny, seed=1),
            rf"refused the request itself.*temperature: must be at least {MIN_TEMPERATURE}",
        )


def test_a_prompt_beyond_the_models_context_is_refused_naming_it(pair) -> None:
    servers, client = pair
    long = [[5] * 60, [6] * 3]  # 60 + 8 new tokens > the tiny model's 64 positions
    request = GenerateRequest(long, 1, SamplingParams(max_new_tokens=8, greedy=True))
    cause = r"prompts\[0\]: 60 tokens \+ sampling.max_new_tokens 8 exceed the model's 64"
    assert_refused_and_no_engine_failure(servers, client, request, cause)


def test_a_value_error_the_engine_raises_is_the_requests_fault(pair) -> None:
    """vLLM raises ValueError for a request it cannot take (a prompt over its context):
    400, not counted towards ENGINE_FAILURES, and not re-sent."""
    servers, client = pair
    for server in servers:  # fault injection: what vLLM answers such a prompt
        engine = server.server.host.engine
        real = engine.generate

        def refuses(*args: Any, real=real, **kwargs: Any) -> Any:
            if args[2].max_new_tokens == 3:
                raise ValueError("The decoder prompt (length 70) is longer than the maximum")
            return real(*args, **kwargs)

        engine.generate = refuses
    request = GenerateRequest(PROMPTS, 1, SamplingParams(max_new_tokens=3))
    for _ in range(ENGINE_FAILURES):
        assert_refused_and_no_engine_failure(servers, client, request, "decoder prompt")


def test_the_job_file_refuses_the_temperatures_the_server_refuses(pair) -> None:
    servers, _ = pair
    document = {
        "apiVersion": "rlft.dev/v1alpha1",
        "kind": "RLFineTune",
        "metadata": {"name": "tiny"},
        "spec": {"model": {"init": {}}, "rollout": {"sampling": {"temperature": 5e-4}}},
    }
    with pytest.raises(JobFileError) as caught:
        parse_job(document, "job.yaml")
    assert caught.value.problems == ["spec.rollout.sampling.temperature: must be ≥ 0.001"]
    body = GenerateRequest(PROMPTS, 1, SamplingParams(temperature=5e-4)).to_json()
    with pytest.raises(ProtocolError, match=r"sampling\.temperature"):
        http_json(f"{servers[0].url}/generate", body, 30)
    document["spec"]["rollout"]["sampling"]["temperature"] = MIN_TEMPERATURE
    sampling = parse_job(document, "job.yaml").spec.rollout.sampling
    body = GenerateRequest(PROMPTS, 2, SamplingParams(temperature=sampling.temperature), seed=3)
    answer = http_json(f"{servers[0].url}/generate", body.to_json(), 30)
    assert all(c["logprobs"] for c in answer["completions"])


# ------------------------------------------------------------------ loads
@pytest.mark.parametrize("fault", ["cut short", "missing"])
def test_a_load_whose_weights_cannot_be_read_keeps_the_served_weights(
    pair, tmp_path: Path, fault: str
) -> None:
    """Nothing was copied yet: the server used to mark its intact weights damaged and
    serve nothing (healthz without a version, generate 503) until another load."""
    from rlft.trainer.weights.store import WEIGHTS_FILE

    servers, client = pair
    server = servers[0]
    store = store_at(tmp_path)
    other, _ = tiny_model(seed=1)
    uri = publish(store, other, 2)
    weights = store.storage.root / uri.rpartition("/")[2] / WEIGHTS_FILE
    if fault == "missing":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:100])
    assert not client.load_weights(client.instances[0], WeightsRequest(2, uri), 60)
    health = http_json(f"{server.url}/healthz", None, 5)
    assert health["ok"] is True and health["policy_version"] == 1 and "reason" not in health
    answer = http_json(f"{server.url}/generate", GenerateRequest(PROMPTS, 1, GREEDY).to_json(), 30)
    assert answer["policy_version"] == 1


# ------------------------------------------------------------ connections
@pytest.fixture
def guarded() -> Iterator[ThreadServer]:
    instance = ThreadServer(token="the-token")
    instance.server.handler_timeout_s = 0.5  # HANDLER_TIMEOUT_S is 30 s
    yield instance
    instance.stop()


def raw_post(server: ThreadServer, headers: str, timeout: float = 10) -> bytes:
    """POST /generate with `headers` and no body; what the server sends before it closes
    the connection (socket.timeout if it keeps it open past `timeout`)."""
    port = server.server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
        received = b""
        while chunk := connection.recv(4096):
            received += chunk
        return received


def test_a_connection_that_never_sends_its_body_is_dropped(guarded) -> None:
    """Unauthenticated, announcing a body it never sends: its thread waited for it
    forever (a few hundred such connections took every thread and socket)."""
    assert raw_post(guarded, "Content-Length: 1000\r\n") == b""


@pytest.mark.parametrize("length", ["-1", "many"])
def test_a_content_length_that_is_no_count_is_a_bad_request(guarded, length: str) -> None:
    """-1 was read as "to the end of the connection", which a client keeping it open
    never reaches; a word was a 500."""
    reply = raw_post(
        guarded, f"Authorization: Bearer the-token\r\nContent-Length: {length}\r\n", timeout=5
    )
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400", head
    assert "Content-Length" in json.loads(body)["error"]
