"""A publication with an instance wedged in a generate call, on real servers over loopback
HTTP: a load waits behind the call in the engine, and the instance's /healthz answers ok
until the stall limit, so nothing tells the publisher that it will never answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rollout_fixtures import (
    PROMPTS,
    ThreadServer,
    redraw,
    servers_at_version_0,
    wait_until,
)

from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout import loads as loads_module
from rlft.trainer.rollout.client import RolloutClient, http_json
from rlft.trainer.rollout.protocol import GenerateRequest
from rlft.trainer.rollout.publisher import WeightPublisher

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TIMEOUT_S = 120.0
"""The publisher's and the client's timeout: what a publication waited, before."""


def test_an_instance_wedged_in_a_generate_call_does_not_hold_up_publications(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each publication waited out the whole timeout for the wedged instance, and the
    trainer with it (its pipeline waits for the version). Now it counts once the steady
    instance took it and the stragglers' wait passed; the wedged one is sent one load, not
    one per version, gets no requests while behind, and catches up once its engine
    returns."""
    monkeypatch.setattr(loads_module, "STRAGGLER_WAIT_FLOOR_S", 2.0)
    model, tokenizer, store, (steady, wedged) = servers_at_version_0(tmp_path)
    host = wedged.server.host
    real_generate, real_load = host.engine.generate, host.load
    entered, release = threading.Event(), threading.Event()
    loads: list[int] = []

    def hangs(*args: Any, **kwargs: Any) -> Any:  # fault injection: a wedged engine
        entered.set()
        release.wait(TIMEOUT_S)
        return real_generate(*args, **kwargs)

    def counted(request: Any) -> Any:
        loads.append(request.version)
        return real_load(request)

    host.engine.generate, host.load = hangs, counted
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    request = GenerateRequest(PROMPTS, 1, greedy, stop_ids=[tokenizer.eos_token_id])
    caller = threading.Thread(
        target=lambda: http_json(f"{wedged.url}/generate", request.to_json(), TIMEOUT_S + 30),
        daemon=True,
    )
    client = RolloutClient([steady.url, wedged.url], timeout_s=TIMEOUT_S, probe_every_s=0.05)
    publisher = WeightPublisher(client, store, "store", TIMEOUT_S, "127.0.0.1", 0.05)
    try:
        caller.start()
        assert entered.wait(30), "the request never reached the engine"
        for instance in client.instances:
            client.probe(instance)
        assert len(client.live()) == 2  # its /healthz answers ok

        started = time.monotonic()
        for version in (1, 2, 3):
            redraw(model, version)
            publisher.publish(model, version)
            publisher.wait(version, timeout=60)
        elapsed = time.monotonic() - started
        assert elapsed < 30, f"three publications took {elapsed:.1f} s"
        assert loads == [1], "the wedged instance was sent more than its one load in flight"
        assert [i.url for i in client.usable()] == [steady.url]
        answer = client.generate(request)
        assert (answer.url, answer.policy_version) == (steady.url, 3)

        release.set()  # the engine returns: the load in flight lands, then the newest
        caller.join(30)
        assert not caller.is_alive(), "the released request never returned"
        wait_until(lambda: host.policy_version == 3, 60, "the wedged instance catches up")
        wait_until(lambda: len(client.usable()) == 2, 30, "it takes requests again")
        assert loads == [1, 3]
    finally:
        release.set()
        publisher.close()
        client.close()
        steady.stop()
        wedged.stop()


def test_an_instance_restarted_without_weights_is_caught_up_without_a_publication(
    tmp_path: Path,
) -> None:
    """A server restarted at an instance's URL whose store read failed answers /healthz
    503 with no version. The client kept the version the old server had, so the instance
    was not behind, no catch-up went to it, and it stayed idle until the next publication
    (none comes at the end of a run, or while the trainer evaluates or checkpoints)."""
    model, _, store, (steady, restarted) = servers_at_version_0(tmp_path)
    client = RolloutClient([steady.url, restarted.url], timeout_s=60, probe_every_s=0.05)
    publisher = WeightPublisher(client, store, "store", 60, "127.0.0.1", 0.05)
    port = int(restarted.url.rsplit(":", 1)[1])
    try:
        redraw(model, 1)
        publisher.publish_now(model, 1)
        restarted.stop()  # fault injection: the server restarts, with no weights
        restarted = ThreadServer(port=port)
        host = restarted.server.host
        client.probe(client.instances[1])  # as its next generate request's failure would
        assert host.policy_version is None
        wait_until(lambda: host.policy_version == 1, 30, "the restarted instance catches up")
        wait_until(lambda: len(client.usable()) == 2, 30, "it takes requests again")
        assert publisher.published == 1  # no publication brought it up
    finally:
        publisher.close()
        client.close()
        steady.stop()
        restarted.stop()
