"""An instance whose catch-up keeps failing (it cannot read the store, it refuses the
trainer) is tried less and less often, not every second for the rest of the run with a
warning each time; once it can load again it is brought up to date."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rollout_fixtures import ThreadServer, store_at, tiny_model

from rlft.trainer.rollout.client import RolloutClient
from rlft.trainer.rollout.protocol import WeightsRequest
from rlft.trainer.rollout.publisher import WeightPublisher
from rlft.trainer.rollout.server import EngineHost

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVERY_S, LONGEST_S = 0.05, 0.8


def test_a_failing_catch_up_backs_off_and_still_lands(tmp_path: Path) -> None:
    a, b = ThreadServer(), ThreadServer()
    host: EngineHost = a.server.host
    real, asked = host.load, []
    broken = [True]

    def load(request: WeightsRequest):  # fault injection: a store it cannot read
        asked.append(time.monotonic())
        if broken[0]:
            raise OSError("s3 GET: access denied")
        return real(request)

    host.load = load  # type: ignore[method-assign]
    client = RolloutClient([a.url, b.url], timeout_s=10, deadline_s=5, probe_every_s=0.05)
    publisher = WeightPublisher(
        client, store_at(tmp_path), "store", 30, "127.0.0.1", EVERY_S, LONGEST_S
    )
    try:
        publisher.publish_now(tiny_model()[0], 1)  # B takes it: published; A is behind
        assert b.server.host.policy_version == 1 and a.server.host.policy_version is None
        time.sleep(3.0)
        tries = len(asked)
        # Every EVERY_S for 3 s would be about 60 tries; doubling waits up to LONGEST_S
        # make 0.05 + 0.1 + 0.2 + 0.4 + 0.8 + 0.8 + … : under 10.
        assert 2 <= tries <= 10, tries
        broken[0] = False
        deadline = time.monotonic() + 5
        while a.server.host.policy_version != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.server.host.policy_version == 1
    finally:
        publisher.close()
        client.close()
        a.stop()
        b.stop()
