"""A broadcast group re-formed (an instance restarted in its pod) on the port the last
group had: a member that was in the last group at the same rank took the request for
its old group, dead since, and the publication waited out the group's timeout before
falling back to the store. Each group is named, and a member joins the one named."""

from __future__ import annotations

import socket
import time

import pytest
from rollout_fixtures import broadcasting, redraw

from rlft.trainer.rollout import publisher as publisher_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_group_reformed_on_the_same_port_is_joined_anew(tmp_path, monkeypatch, caplog):
    with socket.socket() as probe:  # the port every group gets, as an OS may hand out
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(publisher_module, "free_port", lambda host="127.0.0.1": port)
    with broadcasting(tmp_path) as (model, _, servers, client, publisher):
        for version in (1, 2):  # 1 by the store (it builds engines), 2 forms the group
            redraw(model, version)
            publisher.publish_now(model, version)
        servers.restart(1)  # instance 0 stays: rank 1 of the next group, as before
        deadline = time.monotonic() + 120
        while not client.probe(client.instances[1]):
            assert time.monotonic() < deadline, "the restarted instance never served"
            time.sleep(0.1)
        redraw(model, 3)
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="rlft.trainer.rollout.publisher"):
            publisher.publish_now(model, 3)
        assert "broadcast failed" not in caplog.text
        assert time.monotonic() - started < 30
        assert [i.policy_version for i in client.instances] == [3, 3]
