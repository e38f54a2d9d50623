"""The rollout client and server under faults, on real servers over loopback HTTP: an
instance that failed once takes requests again (once it serves the current weights), an
answer cut off mid-body is re-issued, a closed client's requests end with their servers,
and `rlft rollout` as PID 1 of a container stops on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
from processes import descendants, kill_tree
from rollout_fixtures import (
    PROMPTS,
    ThreadServer,
    broadcasting,
    publish,
    redraw,
    store_at,
    tiny_model,
    wait_until,
)

from rlft.trainer.rollout import SamplingParams
from rlft.trainer.rollout.client import (
    ClientClosed,
    Generated,
    RequestFailed,
    RolloutClient,
    http_json,
)
from rlft.trainer.rollout.local import LocalServers
from rlft.trainer.rollout.protocol import GenerateRequest
from rlft.trainer.rollout.publisher import WeightPublisher

GREEDY = SamplingParams(max_new_tokens=8, greedy=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def at_once(client: RolloutClient, count: int, request: GenerateRequest) -> list[Generated]:
    """`count` requests in flight together: each instance that takes requests gets some
    (the least busy one is chosen)."""
    futures = [client.submit(request) for _ in range(count)]
    return [f.result(timeout=120) for f in futures]


# ------------------------------------------------------------ instances coming back
def test_an_instance_that_failed_once_takes_requests_again(tmp_path: Path) -> None:
    """One 500 while another instance is healthy: the request is re-issued there, and the
    failed instance, probed meanwhile, takes later requests again (it used to be lost for
    the rest of the run)."""
    model, tokenizer = tiny_model()
    uri = publish(store_at(tmp_path), model, 0)
    flaky, steady = ThreadServer(), ThreadServer()
    client = RolloutClient([flaky.url, steady.url], timeout_s=30, probe_every_s=0.1)
    try:
        for server in (flaky, steady):
            http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
        engine = flaky.server.host.engine
        generate, calls = engine.generate, []

        def fails_once(*args: Any, **kwargs: Any) -> Any:  # the engine's fault: a 500
            calls.append(1)
            if len(calls) == 1:
                raise OSError("the accelerator stopped answering")
            return generate(*args, **kwargs)

        engine.generate = fails_once
        request = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
        first = client.generate(request)  # ties go to the first instance: the flaky one
        assert (first.url, client.reissued, len(calls)) == (steady.url, 1, 1)
        wait_until(lambda: client.instances[0].healthy, 10, "the failed instance is back")
        later = [client.generate(request) for _ in range(4)]
        assert flaky.url in {a.url for a in later}
        assert {a.policy_version for a in later} == {0}
    finally:
        client.close()
        flaky.stop()
        steady.stop()


def test_a_request_every_instance_times_out_on_ends_at_the_deadline_naming_why(
    tmp_path: Path,
) -> None:
    """Two instances whose generation outlasts the request timeout: each time-out sent the
    request to the other one, probed back meanwhile, forever (the deadline was checked
    only when no instance was usable). It ends at the deadline, naming the time-outs."""
    from rlft.trainer.rollout.client import NoInstanceError

    model, tokenizer = tiny_model()
    uri = publish(store_at(tmp_path), model, 0)
    servers = [ThreadServer(), ThreadServer()]
    client = RolloutClient(
        [s.url for s in servers], timeout_s=0.3, deadline_s=1.5, probe_every_s=0.05
    )
    slow = threading.Event()
    try:
        for server in servers:
            http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
            engine = server.server.host.engine
            real = engine.generate

            def slow_generate(*args: Any, real=real, **kwargs: Any) -> Any:
                slow.wait(1.0)  # longer than the request timeout
                return real(*args, **kwargs)

            engine.generate = slow_generate
        request = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
        future = client.submit(request)
        with pytest.raises(NoInstanceError) as raised:
            future.result(timeout=20)  # before: still re-issuing when the test gave up
        assert "for 2 s" in str(raised.value) and "timed out" in str(raised.value)
        assert client.reissued >= 1
    finally:
        slow.set()
        client.close()
        for server in servers:
            server.stop()


def test_a_request_that_timed_out_on_a_stalled_instance_is_answered_by_another(
    tmp_path: Path,
) -> None:
    """The trainer's client is built with the request timeout alone: its deadline was the
    same 600 s as the timeout, so a request that timed out on a stalled instance was
    never re-issued (the deadline had passed) and the run ended with another instance
    idle. Now it goes to the other instance."""
    model, tokenizer = tiny_model()
    uri = publish(store_at(tmp_path), model, 0)
    stalled, steady = ThreadServer(), ThreadServer()
    client = RolloutClient([stalled.url, steady.url], timeout_s=1.0, probe_every_s=60)
    release = threading.Event()
    try:
        for server in (stalled, steady):
            http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
        engine = stalled.server.host.engine
        real = engine.generate

        def hangs(*args: Any, **kwargs: Any) -> Any:  # a wedged engine
            release.wait(30)
            return real(*args, **kwargs)

        engine.generate = hangs
        request = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
        answer = client.generate(request)  # ties go to the first instance: the stalled one
        assert (answer.url, client.reissued) == (steady.url, 1)
    finally:
        release.set()
        client.close()
        stalled.stop()
        steady.stop()


def test_a_stalled_instance_takes_requests_again_once_it_serves_the_current_weights(
    tmp_path: Path,
) -> None:
    """Two server processes; one is stopped (SIGSTOP) past the request timeout, so the
    client marks it down, and a publication reaches only the other. Continued, it is
    probed back while the other is healthy: live (the next publication goes to it) but
    given no request while it serves the old weights, then requests again once that
    publication loaded the current version into it."""
    model = tiny_model()[0]
    store = store_at(tmp_path)
    publish(store, model, 0)
    request = GenerateRequest(
        PROMPTS * 4, 2, SamplingParams(max_new_tokens=24, greedy=True), stop_ids=[]
    )
    servers = LocalServers(2, "transformers", store.storage.uri, log_dir=tmp_path)
    client = publisher = None
    try:
        client = RolloutClient(servers.start(), timeout_s=3, probe_every_s=0.2, token=servers.token)
        client.wait_ready(120)
        publisher = WeightPublisher(client, store, "store", timeout_s=60)
        running, stalled = client.instances
        stalled_pid = servers.processes[1].pid

        os.kill(stalled_pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while stalled.healthy:  # one of each pair goes to it and times out there
            assert time.monotonic() < deadline, "no request reached the stalled instance"
            assert {a.url for a in at_once(client, 2, request)} == {running.url}
        assert client.reissued >= 1
        redraw(model, 1)
        publisher.publish(model, 1)
        publisher.wait(1, timeout=60)  # loaded by the running instance only
        assert client.current_version == 1

        os.kill(stalled_pid, signal.SIGCONT)
        wait_until(lambda: stalled.healthy, 30, "the continued instance is probed back")
        assert stalled.policy_version == 0
        behind = at_once(client, 4, request)
        assert {(a.url, a.policy_version) for a in behind} == {(running.url, 1)}
        # Given requests only once it serves the current weights. The publisher's
        # catch-up may load them into it at any moment, and on a loaded machine a probe
        # that times out (it works off the requests it held while stopped) marks it down
        # for a while: the state is checked as a rule, not at one instant.
        assert all(i.policy_version == client.current_version for i in client.usable())
        wait_until(lambda: stalled in client.live(), 30, "the continued instance is live")

        redraw(model, 2)
        publisher.publish(model, 2)  # goes to both: the stalled one is live
        publisher.wait(2, timeout=60)
        wait_until(lambda: stalled in client.usable(), 60, "it loads the current weights")
        assert http_json(f"{stalled.url}/healthz", None, 10)["policy_version"] == 2
        caught_up = at_once(client, 4, request)
        assert {a.policy_version for a in caught_up} == {2}
        assert stalled.url in {a.url for a in caught_up}
    finally:
        for process in servers.processes:  # a stopped process would wait out its SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
        if publisher is not None:
            publisher.close()
        if client is not None:
            client.close()
        servers.stop()


# ------------------------------------------------------------- answers cut short
class CuttingServer:
    """A socket server that answers every request with the headers and the start of a
    body, then closes the connection: a pod killed while writing its answer."""

    def __init__(self, framing: str):
        self.framing = framing
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.listener.settimeout(0.1)  # to see stop(): closing it does not end accept()
        self.cut = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                connection, _ = self.listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(10)
                received = b""
                while b"\r\n\r\n" not in received:
                    chunk = connection.recv(65536)
                    if not chunk:
                        break
                    received += chunk
                head, _, body = received.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(body) < length:
                    chunk = connection.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                if self.framing == "content-length":
                    headers = b"Content-Length: 100000\r\n"
                    start = b'{"request_id": "", "completions": ['
                else:
                    headers = b"Transfer-Encoding: chunked\r\n"
                    start = b"400\r\n" + b'{"request_id": "", "completions": ['
                connection.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + headers + b"\r\n"
                )
                connection.sendall(start)
                self.cut += 1

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.listener.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_answer_cut_off_mid_body_is_reissued_to_another_instance(
    tmp_path: Path, framing: str
) -> None:
    """The body of an answer ends early (http.client's IncompleteRead, no OSError): the
    attempt failed like a reset connection, and the request is answered by another
    instance instead of the error ending the rollout pipeline's thread."""
    model, tokenizer = tiny_model()
    cutting, server = CuttingServer(framing), ThreadServer()
    client = RolloutClient([cutting.url, server.url], timeout_s=30, probe_every_s=0.1)
    try:
        with pytest.raises(RequestFailed, match="IncompleteRead"):
            http_json(f"{cutting.url}/generate", {"prompts": [[1]]}, 10)
        uri = publish(store_at(tmp_path), model, 0)
        http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
        request = GenerateRequest(PROMPTS, 1, GREEDY, stop_ids=[tokenizer.eos_token_id])
        answer = client.generate(request)  # ties go to the first instance: the cutting one
        assert answer.url == server.url and answer.policy_version == 0
        assert client.reissued == 1 and cutting.cut >= 2
        assert not client.instances[0].healthy
    finally:
        client.close()
        cutting.stop()
        server.stop()


# --------------------------------------------------------------- closing the client
@pytest.mark.parametrize("order", ["close, then kill", "kill, then close"])
def test_closing_the_client_ends_its_requests_when_the_server_is_gone(
    tmp_path: Path, order: str
) -> None:
    """Requests in flight to a server that is then killed: once the client is closed
    (as a run's session closes it, then stops its servers) they end within seconds,
    instead of retrying the dead server until the deadline (600 s: the interpreter
    joins the client's threads at exit)."""
    model = tiny_model()[0]
    store = store_at(tmp_path)
    publish(store, model, 0)
    request = GenerateRequest(
        PROMPTS * 8, 4, SamplingParams(max_new_tokens=48, greedy=True), stop_ids=[]
    )
    with LocalServers(1, "transformers", store.storage.uri, log_dir=tmp_path) as servers:
        client = RolloutClient(
            servers.start(), timeout_s=30, probe_every_s=0.2, token=servers.token
        )
        try:
            client.wait_ready(120)
            futures = [client.submit(request) for _ in range(8)]
            wait_until(lambda: client.instances[0].in_flight > 0, 60, "a request in flight")
            threads = list(client._pool._threads)
            if order == "close, then kill":
                client.close()
                servers.kill(0)
            else:
                servers.kill(0)
                wait_until(lambda: not client.instances[0].healthy, 30, "the failure seen")
                client.close()
            closed = time.monotonic()
            for future in futures:
                with contextlib.suppress(ClientClosed, CancelledError):
                    future.result(timeout=max(0.1, closed + 10 - time.monotonic()))
            for thread in threads:
                thread.join(timeout=max(0.1, closed + 10 - time.monotonic()))
            assert not [t.name for t in threads if t.is_alive()]
            ended = [f.exception() for f in futures if not f.cancelled()]
            assert any(isinstance(e, ClientClosed) for e in ended)
        finally:
            client.close()


# ---------------------------------------------------------- SIGTERM as a pod's PID 1
def test_rlft_rollout_as_pid_1_stops_on_sigterm(tmp_path: Path) -> None:
    """A rollout pod's container runs `rlft rollout …` as PID 1, and the kernel drops a
    signal PID 1 has no handler for: the server must install its SIGTERM handler however
    it is started, or every pod deletion waits out the grace period for the SIGKILL."""
    # `make setup` installs the console script beside the interpreter; PID namespaces need
    # root, as the test cluster does (the containers' namespaces).
    rlft = Path(sys.executable).with_name("rlft")
    assert rlft.exists(), f"no {rlft}: run `make setup`"
    ready = tmp_path / "ready.json"
    # The arguments of the operator's rollout pods (operator/manifests.py), no job file.
    command = [
        *("unshare", "--pid", "--fork", "--mount-proc"),
        *(str(rlft), "rollout", "--engine", "transformers"),
        *("--host", "127.0.0.1", "--port", "0", "--instance", "0"),
        *("--ready-file", str(ready)),
    ]
    log = (tmp_path / "rollout.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: ready.exists() or process.poll() is not None, 120, "it listens")
        assert process.poll() is None, (tmp_path / "rollout.log").read_text()
        assert json.loads(ready.read_text())["pid"] == 1  # PID 1 of its own namespace
        server = descendants(process.pid)[0]  # unshare's child: the namespace's PID 1
        port = json.loads(ready.read_text())["port"]
        assert http_json(f"http://127.0.0.1:{port}/livez", None, 10)["ok"]
        os.kill(server, signal.SIGTERM)
        try:
            code = process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("rlft rollout as PID 1 ignored SIGTERM")
        assert code == 0, (tmp_path / "rollout.log").read_text()
    finally:
        if process.poll() is None:
            kill_tree(process)
        log.close()


def test_the_broadcast_group_is_at_the_pods_ip(monkeypatch, tmp_path):
    """Rollout pods join the trainer's broadcast group at the address it names: in a pod
    that must be the pod's IP (the operator sets RLFT_POD_IP), not loopback, which is
    each pod's own (the group was always at 127.0.0.1: every broadcast timed out)."""
    from rlft.trainer.weights.store import WeightStore

    store = WeightStore.at(tmp_path.as_uri())
    client = RolloutClient(["http://127.0.0.1:9"], 1.0)
    try:
        monkeypatch.setenv("RLFT_POD_IP", "10.1.2.3")
        in_a_pod = WeightPublisher(client, store, "broadcast")
        monkeypatch.delenv("RLFT_POD_IP")
        local = WeightPublisher(client, store, "broadcast")
        assert (in_a_pod.host, local.host) == ("10.1.2.3", "127.0.0.1")
        in_a_pod.close()
        local.close()
    finally:
        client.close()


def test_a_broadcast_to_no_live_instance_is_not_a_publication(tmp_path):
    """Every instance down when a version is broadcast: the trainer's group of one sent
    to nobody and the version counted as published (the next batch started on weights no
    instance served). It is retried and fails when none comes back."""
    model, _ = tiny_model()
    store = store_at(tmp_path)
    client = RolloutClient(["http://127.0.0.1:9"], timeout_s=1.0, probe_every_s=0.1)
    publisher = WeightPublisher(client, store, "broadcast", timeout_s=3)
    try:
        publisher.published = 1  # past the first version (by the store): broadcasts
        # Nothing listens at its port: the client's own probe is refused and finds it down.
        assert not client.probe(client.instances[0])
        assert client.live() == []
        publisher.publish(model, 5)
        with pytest.raises(RuntimeError, match="no live rollout instance"):
            publisher.wait(5, timeout=30)
        assert publisher.acked < 5
    finally:
        publisher.close()
        client.close()


def test_broadcast_groups_are_formed_when_members_change_and_leave_the_store_a_copy(
    tmp_path, caplog
):
    """Weights by broadcast skip the store, but an instance that restarts reads the
    store's newest version: each time the group is (re)formed its version is written
    there too (documented, never done: a restarted instance served weights every step
    too stale to train on). A rollout container restarted in its pod answers at the same
    URL but is not in the group: the group is re-formed for the next version at once (it
    was reused, the new process waited to join a group nobody formed, and the
    publication stalled for the group's 60 s timeout before falling back to the store)."""
    with broadcasting(tmp_path) as (model, store, servers, client, publisher):
        for version in (1, 2, 3):  # 1 by the store (it builds engines), 2 and 3 broadcast
            redraw(model, version)
            publisher.publish_now(model, version)
        assert [i.policy_version for i in client.instances] == [3, 3]
        assert store.latest() == 2  # the group formed at 2, and was kept for 3
        assert store.numbers() == [0, 1, 2]
        url = client.instances[1].url
        assert servers.restart(1) == url
        wait_until(lambda: client.probe(client.instances[1]), 120, "the restart serves")
        redraw(model, 4)
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="rlft.trainer.rollout.publisher"):
            publisher.publish_now(model, 4)
        assert time.monotonic() - started < 30
        assert "broadcast failed" not in caplog.text
        assert [i.policy_version for i in client.instances] == [4, 4]
        assert store.latest() == 4  # the group was formed again, at 4
