"""Rollout instances and trainer gangs: the operator replaces a gang whose node stopped
reporting, and the old gang, cut off from the API server but not from the rollout pods,
may still train and publish. An instance takes the weights of the newest gang that sent
any, refuses an older gang's (409), and does not keep a replaced gang's weights because
their version numbers ran past the new gang's."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_fixtures import ThreadServer, broadcasting, publish, redraw, store_at, tiny_model

from rlft.trainer.rollout.client import http_json
from rlft.trainer.rollout.protocol import SupersededGangError, WeightsRequest
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
