"""An instance whose catch-up keeps failing (it cannot read the store, it refuses the
trainer) is tried less and less often, not every second for the rest of the run with a
warning each time; once it can load again it is brought up to date."""

from __future__ import annotations

import time

import pytest
from checkpoint_fixtures import s3_options
from rollout_fixtures import ThreadServer, reading_through, tiny_model, wait_until
from s3_proxy import S3Proxy
from seaweedfs import SeaweedServer

from rlft.trainer.rollout.client import RolloutClient
from rlft.trainer.rollout.publisher import WeightPublisher
from rlft.trainer.weights.store import WeightStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVERY_S, LONGEST_S = 0.05, 0.8


def test_a_failing_catch_up_backs_off_and_still_lands(
    s3_env: SeaweedServer, bucket: str, store_proxy: S3Proxy
) -> None:
    proxy = store_proxy
    # The fault: every read of A's is answered 403 AccessDenied (a key scoped away from
    # the weights), each load one refused request; B reads the store directly.
    proxy.deny("/")
    a, b = ThreadServer(s3=reading_through(proxy.url)), ThreadServer(s3=s3_options(s3_env))
    store = WeightStore.at(f"s3://{bucket}/weights", s3=s3_options(s3_env))
    client = RolloutClient([a.url, b.url], timeout_s=10, deadline_s=5, probe_every_s=0.05)
    publisher = WeightPublisher(client, store, "store", 30, "127.0.0.1", EVERY_S, LONGEST_S)
    try:
        published = time.monotonic()
        publisher.publish_now(tiny_model()[0], 1)  # B takes it: published; A is behind
        assert b.server.host.policy_version == 1 and a.server.host.policy_version is None
        # It tries again (waited for: a loaded machine's first tries come late)...
        wait_until(lambda: proxy.denied >= 2, 30, "a second catch-up try")
        time.sleep(max(0.0, 3.0 - (time.monotonic() - published)))
        tries, elapsed = proxy.denied, time.monotonic() - published
        # ...but backs off: every EVERY_S would be about 60 tries in 3 s; doubling waits
        # up to LONGEST_S make 0.05 + 0.1 + 0.2 + 0.4 + 0.8 + 0.8 + …: 5 tries in the
        # first 1.55 s, then one per LONGEST_S (a slow machine only makes fewer).
        assert tries <= 6 + elapsed / LONGEST_S, (tries, elapsed)
        proxy.release()
        deadline = time.monotonic() + 5
        while a.server.host.policy_version != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.server.host.policy_version == 1
    finally:
        publisher.close()
        client.close()
        a.stop()
        b.stop()
