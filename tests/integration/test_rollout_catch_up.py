"""Instances that fell behind get the weights again, on real servers over loopback HTTP:
one whose load of the newest version failed while another took it, one with no weights
yet whose first load failed, and one that acknowledged a load is live at once. A
publication no instance took names why. Local servers end with the trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoint_fixtures import s3_options
from rollout_fixtures import PROMPTS, ThreadServer, publish, reading_through, store_at, tiny_model
from s3_proxy import S3Proxy
from seaweedfs import SeaweedServer

from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout.client import RolloutClient, http_json
from rlft.trainer.rollout.protocol import GenerateRequest, WeightsRequest
from rlft.trainer.rollout.publisher import WeightPublisher
from rlft.trainer.telemetry.metrics import ROLLOUT_REQUESTS
from rlft.trainer.weights.store import WeightStore, version_key

GREEDY = SamplingParams(max_new_tokens=4, greedy=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def servers() -> Iterator[list[ThreadServer]]:
    started = [ThreadServer(), ThreadServer()]
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def stopped() -> Iterator[list[object]]:
    """Clients and publishers the test made, closed after it (publishers first)."""
    made: list[object] = []
    yield made
    for thing in sorted(made, key=lambda t: not isinstance(t, WeightPublisher)):
        thing.close()  # type: ignore[attr-defined]


@pytest.fixture
def proxies(s3_env: SeaweedServer) -> Iterator[list[S3Proxy]]:
    """Two pass-through proxies to the session's SeaweedFS: the store as each of
    `readers` sees it (a proxy refuses reads where the store is down for that server)."""
    started = [S3Proxy(s3_env.endpoint), S3Proxy(s3_env.endpoint)]
    yield started
    for proxy in started:
        proxy.stop()


@pytest.fixture
def readers(proxies: list[S3Proxy]) -> Iterator[list[ThreadServer]]:
    """Two servers, the first reading the store through proxies[0], the second through
    proxies[1]."""
    started = [ThreadServer(s3=reading_through(proxy.url)) for proxy in proxies]
    yield started
    for server in started:
        server.stop()


def s3_store(s3_env: SeaweedServer, bucket: str, prefix: str = "weights") -> WeightStore:
    """A publication location on a real SeaweedFS bucket, written past the proxies."""
    return WeightStore.at(f"s3://{bucket}/{prefix}", s3=s3_options(s3_env))


def version_at(server: ThreadServer) -> int | None:
    return server.server.host.policy_version


def test_an_instance_whose_load_failed_is_sent_the_version_again(
    readers, proxies, stopped, s3_env, bucket
) -> None:
    """Version 2 fails on A (transient) and reaches B, so it is published; B then dies.
    A answers but serves version 1, so it takes no requests, and nothing sent it 2 again:
    generation stalled until the deadline although 2 was in the store."""
    a, b = readers
    store = s3_store(s3_env, bucket)
    model, _ = tiny_model()
    # The fault: the store answers A's first read of version 2 with 503 (down for it).
    proxies[0].refuse(f"/{version_key(2)}/", reads=True, times=1)
    client = RolloutClient([a.url, b.url], timeout_s=10, deadline_s=5, probe_every_s=0.1)
    publisher = WeightPublisher(client, store, "store", 30, "127.0.0.1", catch_up_every_s=0.1)
    stopped += [client, publisher]
    publisher.publish_now(model, 1)
    publisher.publish_now(model, 2)
    assert version_at(b) == 2
    assert len(proxies[0].held_paths) == 1, proxies[0].held_paths
    # A answered that load 500 (the store's error, not a bad request): one error counted.
    errors = a.server.metrics.registry.get_sample_value(ROLLOUT_REQUESTS.name, {"status": "error"})
    assert errors == 1.0, errors
    b.stop()
    answer = client.generate(GenerateRequest(PROMPTS, 1, GREEDY))
    assert answer.url == a.url and answer.policy_version == 2


def test_a_fresh_instance_whose_first_load_failed_is_loaded_again(
    readers, proxies, stopped, s3_env, bucket
) -> None:
    """An instance with no weights answers /healthz 503; once its first load failed it
    never counted as live again ("no live rollout instance"), alone or beside others."""
    model, _ = tiny_model()
    # The faults: the store answers 503 to the first read of each server's first load
    # (version 1 for the first, version 2 for the second).
    proxies[0].refuse(f"/{version_key(1)}/", reads=True, times=1)
    proxies[1].refuse("/", reads=True, times=1)
    alone = RolloutClient([readers[0].url], timeout_s=10, deadline_s=5, probe_every_s=0.1)
    publisher = WeightPublisher(alone, s3_store(s3_env, bucket, "alone"), "store", 8, "127.0.0.1")
    stopped += [alone, publisher]
    publisher.publish_now(model, 1)
    assert version_at(readers[0]) == 1
    assert len(proxies[0].held_paths) == 1, proxies[0].held_paths

    # Beside one that took it: the publication is done, and only the catch-up loads it.
    a, b = readers
    pair = RolloutClient([a.url, b.url], timeout_s=10, deadline_s=5, probe_every_s=0.1)
    store = s3_store(s3_env, bucket, "pair")
    publisher = WeightPublisher(pair, store, "store", 8, "127.0.0.1", 0.1)
    stopped += [pair, publisher]
    publisher.publish_now(model, 2)
    deadline = time.monotonic() + 5
    while version_at(b) != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert version_at(b) == 2
    assert http_json(f"{b.url}/healthz", None, 5)["policy_version"] == 2
    assert [version_key(2) in path for path in proxies[1].held_paths] == [True]


def test_a_publication_nobody_took_names_the_instances_errors(stopped, tmp_path) -> None:
    """A trainer with another job's token: the publication failed after its timeout with
    "no live rollout instance", the 401 the client had seen left out."""
    guarded = ThreadServer(token="the-instances-token")
    try:
        client = RolloutClient([guarded.url], timeout_s=5, deadline_s=5, token="a-stale-token")
        publisher = WeightPublisher(client, store_at(tmp_path), "store", 2, "127.0.0.1")
        stopped += [client, publisher]
        with pytest.raises(RuntimeError, match="weight publication failed") as caught:
            publisher.publish_now(tiny_model()[0], 1)
        assert f"{guarded.url}/weights: HTTP 401" in str(caught.value)
        assert "refused this client's rollout token" in str(caught.value)
    finally:
        guarded.stop()


def test_an_instance_that_acknowledged_a_load_is_live_at_once(servers, stopped, tmp_path) -> None:
    """A weightless instance probed while its first load ran (503) is down; the load's
    acknowledgement left it so until the next probe: out of the publications and the
    requests meanwhile."""
    a, _ = servers
    client = RolloutClient([a.url], timeout_s=10, deadline_s=5, probe_every_s=60)
    stopped.append(client)
    instance = client.instances[0]
    assert not client.probe(instance)  # no weights yet: 503, not live
    uri = publish(store_at(tmp_path), tiny_model()[0], 1)
    assert client.load_weights(instance, WeightsRequest(1, uri), 60)
    assert client.live() == [instance] and client.usable() == [instance]


# ------------------------------------------------------- local servers, trainer gone
TRAINER = """
import sys, time
from pathlib import Path
from rlft.trainer.rollout.local import LocalServers
servers = LocalServers(1, "transformers", sys.argv[1], log_dir=Path(sys.argv[2]))
servers.start()
print(servers.processes[0].pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """A process standing in for `rlft train`: it starts one local rollout server (no
    weights yet: it starts in seconds) and prints its pid."""
    weights = (tmp_path / "weights").as_uri()
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER, weights, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


def test_local_servers_end_when_the_trainer_is_killed(trainer: subprocess.Popen) -> None:
    """SIGKILL (the OOM killer) runs none of the trainer's cleanup: its rollout servers
    lived on, orphaned, holding their ports (and GPUs)."""
    server = int(trainer.stdout.readline())  # type: ignore[union-attr]
    try:
        assert not gone(server)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 10
        while not gone(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(server), "the rollout server outlived its trainer"
    finally:
        if not gone(server):
            os.kill(server, signal.SIGKILL)
