"""Rollout instances and trainer gangs: the operator replaces a gang whose node stopped
reporting, and the old gang, cut off from the API server but not from the rollout pods,
may still train and publish. An instance takes the weights of the newest gang that sent
any, refuses an older gang's (409), and does not keep a replaced gang's weights because
their version numbers ran past the new gang's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from rollout_fixtures import (
    PROMPTS,
    ThreadServer,
    broadcasting,
    publish,
    redraw,
    servers_at_version_0,
    store_at,
    tiny_model,
    wait_until,
)

from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout.client import RolloutClient, http_json
from rlft.trainer.rollout.protocol import GenerateRequest, SupersededGangError, WeightsRequest
from rlft.trainer.rollout.publisher import WeightPublisher


def test_a_new_gangs_first_weights_replace_an_old_gangs_numbered_past_them(tmp_path: Path):
    """The old gang trained on and published version 10 before the instance heard from
    the new gang, which resumed at 5: its 5 is served (a version check alone kept 10, and
    the new gang trained on the replaced gang's samples until it passed 10). Within a
    gang, an older version still never replaces a newer one (a retried load arriving
    late)."""
    server = ThreadServer()
    try:
        store = store_at(tmp_path)
        model, _ = tiny_model(seed=0)
        old = publish(store, model, 10)
        redraw(model, 1)
        new = publish(store, model, 5)
        stale = publish(store, model, 4)
        load = f"{server.url}/weights"
        assert (
            http_json(load, WeightsRequest(10, old, gang=1).to_json(), 60)["policy_version"] == 10
        )
        assert http_json(load, WeightsRequest(5, new, gang=3).to_json(), 60)["policy_version"] == 5
        assert (
            http_json(load, WeightsRequest(4, stale, gang=3).to_json(), 60)["policy_version"] == 5
        )
        with pytest.raises(SupersededGangError, match="gang attempt 1 refused"):
            http_json(load, WeightsRequest(11, old, gang=1).to_json(), 60)
        host = server.server.host
        assert (host.policy_version, host.served_gang, host.gang) == (5, 3, 3)
    finally:
        server.stop()


def test_a_replaced_gang_broadcasting_ends_without_writing_the_store(tmp_path: Path):
    """The instances refuse the old gang's broadcast before joining its group, which
    then times out. The publisher used to fall back to the store there, writing the
    replaced gang's weights where the new gang's are, before meeting the 409 again."""
    with broadcasting(tmp_path, count=1) as (model, store, servers, client, _):
        (url,) = servers.urls
        version_0 = store.uri_of(0)
        new_gang = WeightsRequest(0, version_0, gang=3).to_json()
        http_json(f"{url}/weights", new_gang, 60, servers.token)
        publisher = WeightPublisher(client, store, "broadcast", timeout_s=5, gang=1)
        try:
            publisher.published = 1  # past the first version (by the store): broadcasts
            redraw(model, 2)
            publisher.publish(model, 7)
            with pytest.raises(SupersededGangError, match="gang attempt 1 refused"):
                publisher.wait(7, timeout=60)
        finally:
            publisher.close()
        assert store.numbers() == [0]  # no store copy of the old gang's version 7
        assert http_json(f"{url}/healthz", None, 10)["policy_version"] == 0


def test_an_old_gangs_load_waiting_behind_a_request_is_refused_once_a_new_gang_loaded(
    tmp_path: Path,
):
    """A load waits for the request in the engine (updates are atomic per request). The
    old gang's load came first and was let in; the new gang's came while both waited.
    Whichever then went first, the old gang's used to land too, and when it went second
    its version (numbered past the new gang's) replaced the new gang's weights."""
    server = ThreadServer()
    host = server.server.host
    try:
        store = store_at(tmp_path)
        model, _ = tiny_model(seed=0)
        load = f"{server.url}/weights"
        http_json(load, WeightsRequest(0, publish(store, model, 0)).to_json(), 60)
        old, new = publish(store, model, 10), publish(store, model, 5)
        entered, release = threading.Event(), threading.Event()
        generate = host.engine.generate

        def long_request(*args, **kwargs):  # a long generate request in the engine
            entered.set()
            release.wait(60)
            return generate(*args, **kwargs)

        host.engine.generate = long_request
        answers: dict[str, object] = {}

        def send(name: str, request: WeightsRequest) -> None:
            try:
                answers[name] = http_json(load, request.to_json(), 60)
            except SupersededGangError as refused:
                answers[name] = refused

        greedy = SamplingParams(max_new_tokens=2, greedy=True)
        asking = threading.Thread(
            target=http_json,
            args=(f"{server.url}/generate", GenerateRequest(PROMPTS, 1, greedy).to_json(), 60),
        )
        asking.start()
        assert entered.wait(30)
        loads = [
            threading.Thread(target=send, args=("old", WeightsRequest(10, old, gang=1))),
            threading.Thread(target=send, args=("new", WeightsRequest(5, new, gang=3))),
        ]
        for waiting, thread in enumerate(loads, start=1):
            thread.start()
            wait_until(lambda n=waiting: host._writers_waiting == n, 30, f"{waiting} waiting")
        release.set()
        for thread in [asking, *loads]:
            thread.join(60)
        assert isinstance(answers["old"], SupersededGangError), answers
        assert host.policy_version == 5 and host.served_gang == 3
    finally:
        release.set()
        server.stop()


def test_a_catch_up_refused_by_a_new_gang_stops_the_old_gangs_publications(tmp_path: Path):
    """A catch-up is sent in the background and not waited for: its 409 (a new gang took
    the instance, from its checkpoint's older version) used to be logged and nothing more,
    and the replaced gang went on publishing, writing its weights into the store. Now the
    trainer's next call raises the refusal, and no store copy is written after it."""
    model, _, store, (kept, taken) = servers_at_version_0(tmp_path)
    client = RolloutClient([kept.url, taken.url], timeout_s=60, probe_every_s=0.05)
    publisher = WeightPublisher(client, store, "store", 60, "127.0.0.1", 0.05, gang=1)
    try:
        redraw(model, 1)
        publisher.publish_now(model, 1)
        new_gang = WeightsRequest(0, store.uri_of(0), gang=3).to_json()
        http_json(f"{taken.url}/weights", new_gang, 60)  # the new gang resumed at version 0
        client.probe(client.instances[1])  # as a generate answer's version would tell it

        def refused() -> bool:  # version 1 is acknowledged: only the publisher's error raises
            try:
                publisher.wait(1, timeout=1)
            except SupersededGangError:
                return True
            return False

        wait_until(refused, 30, "the catch-up's refusal to reach the trainer")
        redraw(model, 2)
        with pytest.raises(SupersededGangError, match="gang attempt 1 refused"):
            publisher.publish(model, 2)
        time.sleep(0.5)  # what the publisher thread would write, it would have begun
        assert store.numbers() == [0, 1]  # no store copy of the old gang's version 2
        assert taken.server.host.served_gang == 3 and taken.server.host.policy_version == 0
    finally:
        publisher.close()
        client.close()
        kept.stop()
        taken.stop()
