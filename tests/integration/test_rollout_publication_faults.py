"""Publication and serving under faults a long run meets, on real servers over loopback
HTTP: a load refused for a while (the publication is retried, its store copy written
once), an instance whose load failed part-way before the first publication (it gets no
requests), a caller that gave up on its request (no error counted), and a caller without the token
sending a large body (not held in memory), an engine hung in a generate call (its
liveness probe fails)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_fixtures import s3_options
from rollout_fixtures import (
    PROMPTS,
    ThreadServer,
    publish,
    reading_through,
    servers_at_version_0,
    store_at,
    tiny_model,
)
from s3_proxy import S3Proxy
from safetensors.torch import save as save_safetensors
from seaweedfs import SeaweedServer

from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout.client import RequestFailed, RolloutClient, http_json
from rlft.trainer.rollout.protocol import GenerateRequest
from rlft.trainer.rollout.publisher import WeightPublisher
from rlft.trainer.telemetry.metrics import ROLLOUT_REQUESTS
from rlft.trainer.weights.store import WeightStore, config_json, unique_tensors, version_key

GREEDY = SamplingParams(max_new_tokens=4, greedy=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_retried_publication_writes_its_store_copy_once(
    s3_env: SeaweedServer, bucket: str, store_proxy: S3Proxy
) -> None:
    """The instance refuses loads for a while (restarting, its store unreadable): each
    retry of the publication uploaded the whole model to the store again."""
    proxy = store_proxy
    # The fault: the store answers the instance's first two reads of version 1 with 503
    # (down for it), so its first two loads fail; the publisher writes past the proxy.
    proxy.refuse(f"/{version_key(1)}/", reads=True, times=2)
    server = ThreadServer(s3=reading_through(proxy.url))
    host = server.server.host
    store = WeightStore.at(f"s3://{bucket}/weights", s3=s3_options(s3_env))
    written: list[int] = []
    write = store.write

    def counted(version: int, weights: bytes, config: str) -> str:
        written.append(version)
        return write(version, weights, config)

    store.write = counted  # type: ignore[method-assign]
    client = RolloutClient([server.url], timeout_s=10, probe_every_s=0.05)
    publisher = WeightPublisher(client, store, "store", 30, "127.0.0.1")
    try:
        publisher.publish_now(tiny_model()[0], 1)
        assert len(proxy.held_paths) == 2 and host.policy_version == 1, proxy.held_paths
        assert written == [1]
    finally:
        publisher.close()
        client.close()
        server.stop()


def test_an_instance_damaged_before_the_first_publication_gets_no_requests(
    tmp_path: Path,
) -> None:
    """A load failed part-way: the instance answers /healthz (ok, no version) so that the
    next load reaches it. Before the client knew any version it took generate requests,
    refused each, and was probed back, round and round."""
    model, tokenizer, store, (damaged, steady) = servers_at_version_0(tmp_path)
    # The fault: version 1 names the model's tensors but one has the wrong shape; the
    # load copies the others before it fails on that one (part old, part new weights).
    tensors = unique_tensors(model.state_dict())
    name, wrong = next(reversed(tensors.items()))
    tensors[name] = torch.zeros(wrong.shape[0] + 1, *wrong.shape[1:])
    bad = store.write(1, save_safetensors(tensors), config_json(model))
    with pytest.raises(RequestFailed, match=f"HTTP 503 .*size mismatch for {re.escape(name)}"):
        http_json(f"{damaged.url}/weights", {"version": 1, "uri": bad}, 60)
    health = http_json(f"{damaged.url}/healthz", None, 5)
    assert health["policy_version"] is None and "failed part-way" in health["reason"], health
    client = RolloutClient([damaged.url, steady.url], timeout_s=10, probe_every_s=0.05)
    try:
        for instance in client.instances:
            client.probe(instance)
        assert client.current_version is None
        request = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
        answers = [client.generate(request) for _ in range(3)]
        assert {a.url for a in answers} == {steady.url} and client.reissued == 0
    finally:
        client.close()
        damaged.stop()
        steady.stop()


def test_a_caller_that_gave_up_is_no_error_of_the_server(tmp_path: Path) -> None:
    """The caller timed out and went (the client re-issues elsewhere): the reply's broken
    pipe was counted as a server error and answered again, with a traceback."""
    model, tokenizer = tiny_model()
    uri = publish(store_at(tmp_path), model, 0)
    server = ThreadServer()
    http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
    engine = server.server.host.engine
    real, gone, handled = engine.generate, threading.Event(), threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Any:
        # Held until the caller has given up, not for a time longer than its timeout:
        # the order is then certain however loaded the machine.
        assert gone.wait(30), "the caller never gave up"
        return real(*args, **kwargs)

    engine.generate = slow
    finish = server.server.finish_request

    def finished(*args: Any, **kwargs: Any) -> None:
        # The handler is done with the request (counted it, and replied to nobody, or
        # counted an error): a fixed sleep after the engine returned missed both there.
        try:
            finish(*args, **kwargs)
        finally:
            handled.set()

    server.server.finish_request = finished  # type: ignore[method-assign]
    request = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
    try:
        with pytest.raises(RequestFailed):
            http_json(f"{server.url}/generate", request.to_json(), 0.2)
        gone.set()
        assert handled.wait(30), "the handler never finished the request"
        registry = server.server.metrics.registry
        counts = {
            status: registry.get_sample_value(ROLLOUT_REQUESTS.name, {"status": status})
            for status in ("ok", "error")
        }
        assert counts == {"ok": 1.0, "error": None}, counts
    finally:
        gone.set()  # a failed test leaves no handler waiting out its 30 s
        server.stop()


def test_a_large_body_without_the_token_is_not_held_in_memory() -> None:
    """A caller without the token made the server read its whole body (up to 64 MiB) at
    once before the 401: a few connections held hundreds of MiB."""
    server = ThreadServer(token="the-token")
    port = server.server.server_address[1]
    body = 32 << 20
    tracemalloc.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
            head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {body}\r\n\r\n"
            connection.sendall(head.encode())
            chunk = b"x" * (1 << 20)
            for _ in range(body >> 20):
                connection.sendall(chunk)
            reply = connection.recv(4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        server.stop()
    assert reply.split(b" ")[1] == b"401", reply[:80]
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB traced at the peak"


def test_a_hung_engine_fails_the_liveness_probe_and_is_live_again_once_it_returns(
    tmp_path: Path,
) -> None:
    """A generate call that never returns failed nothing, so /livez stayed 200 and
    /healthz ok: the pod was never replaced, and every request and load sent to it
    waited out the trainer's timeout. Past the stall limit both answer 503."""
    model, tokenizer = tiny_model()
    uri = publish(store_at(tmp_path), model, 0)
    server = ThreadServer()
    server.server.stall_s = 0.5
    http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
    engine = server.server.host.engine
    real, entered, release = engine.generate, threading.Event(), threading.Event()

    def hangs(*args: Any, **kwargs: Any) -> Any:  # fault injection: a wedged engine
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    engine.generate = hangs
    request = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
    caller = threading.Thread(
        target=lambda: http_json(f"{server.url}/generate", request.to_json(), 60), daemon=True
    )
    try:
        assert _status(f"{server.url}/livez") == (200, None)
        caller.start()
        # The call is in the engine, then past the stall limit: a fixed sleep of twice
        # the limit was not always enough for the request to reach the engine at all.
        assert entered.wait(30), "the request never reached the engine"
        code, reason = _wait_for_status(f"{server.url}/livez", 503, 30)
        assert code == 503 and "one generate call has been in the engine" in reason
        assert _status(f"{server.url}/healthz")[0] == 503
        release.set()
        caller.join(30)
        assert not caller.is_alive(), "the released request never returned"
        assert _status(f"{server.url}/livez") == (200, None)
        assert _status(f"{server.url}/healthz")[0] == 200
    finally:
        release.set()
        server.stop()


def _status(url: str) -> tuple[int, str | None]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read()).get("reason")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()).get("reason")


def _wait_for_status(url: str, code: int, timeout: float) -> tuple[int, str | None]:
    """`url`'s first answer with status `code`, or its last one after `timeout` s."""
    deadline = time.monotonic() + timeout
    answer = _status(url)
    while answer[0] != code and time.monotonic() < deadline:
        time.sleep(0.05)
        answer = _status(url)
    return answer


def test_the_stall_limit_is_twice_the_jobs_request_timeout_unless_given() -> None:
    from argparse import Namespace

    from tiny_jobs import arithmetic_rl_spec

    from rlft.trainer.config import RLFineTune
    from rlft.trainer.rollout.server import stall_seconds

    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=2)
    spec.setdefault("rollout", {})["requestTimeoutSeconds"] = 45
    job = RLFineTune.model_validate(
        {"apiVersion": "rlft.dev/v1alpha1", "kind": "RLFineTune", "metadata": {"name": "j"},
         "spec": spec}
    )  # fmt: skip
    assert stall_seconds(Namespace(stall_seconds=None), job) == 90
    assert stall_seconds(Namespace(stall_seconds=7.0), job) == 7
    assert stall_seconds(Namespace(stall_seconds=None), None) == 0


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_stall_limit_below_zero_is_refused(value: str) -> None:
    """A negative limit made every generate call count as stuck at once."""
    import argparse

    from rlft.trainer.rollout.arguments import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--stall-seconds", "2.5"]).stall_seconds == 2.5
    with pytest.raises(SystemExit):
        parser.parse_args(["--stall-seconds", value])
