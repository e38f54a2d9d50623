"""A trainer rank's liveness: progress answers 200, a stall 503 (over real sockets), the
stall is written as the rank's verdict before anything can kill it, a wait for rank 0
is not judged, and the long legitimate operations keep beating while they are alive."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlft.trainer import termination
from rlft.trainer.checkpoint.saver import Checkpointer
from rlft.trainer.learner import faults
from rlft.trainer.rollout.engine import Completion
from rlft.trainer.rollout.pipeline import RolloutPipeline
from rlft.trainer.run.evaluate import greedy_accuracy
from rlft.trainer.storage.errors import StorageError
from rlft.trainer.storage.retry import with_retries
from rlft.trainer.telemetry import liveness
from rlft.trainer.telemetry.liveness import Liveness
from rlft.trainer.telemetry.liveness_server import LivenessServer, Watch, start, watch_interval


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def verdict_in(log: dict[str, str]) -> termination.Verdict | None:
    return termination.read(Path(log[termination.ENV]).read_text())


@pytest.fixture
def log(tmp_path) -> dict[str, str]:
    return {termination.ENV: str(tmp_path / "termination-log")}


@pytest.fixture
def installed() -> Iterator[Clock]:
    """A liveness with a hand-driven clock installed for the process, then the default."""
    clock = Clock()
    before = liveness.current()
    liveness.install(Liveness(60, clock=clock))
    yield clock
    liveness.install(before)


def test_progress_is_live_and_a_stall_is_not_over_http(log):
    clock = Clock()
    live = Liveness(20, rank=1, clock=clock, environ=log)
    server = LivenessServer(live)
    started = server.url.replace("/livez", "/started")
    try:
        clock.now += 600  # importing torch, loading the model: the startup probe's to judge
        assert get(server.url)[0] == 200 and get(started)[0] == 503
        live.begin()
        assert get(started)[0] == 200
        clock.now += 19
        code, body = get(server.url)
        assert code == 200 and body["alive"] and body["last"] == "the loop began"
        live.beat("GRPO step 7: done")
        clock.now += 21
        code, body = get(server.url)
        assert code == 503 and not body["alive"] and body["idleSeconds"] == 21
        assert body["last"] == "GRPO step 7: done" and body["stallTimeoutSeconds"] == 20
        live.beat("GRPO step 8: started")
        assert get(server.url)[0] == 200
    finally:
        server.close()


def test_a_stall_is_the_ranks_verdict_until_it_recovers(log):
    clock = Clock()
    live = Liveness(20, rank=1, clock=clock, environ=log)
    live.begin()
    live.beat("GRPO step 7: done")
    clock.now += 25
    assert not live.check().alive and live.stalled
    verdict = verdict_in(log)
    assert verdict is not None and verdict.stalled and verdict.rank == 1
    assert verdict.exit_code == 1 and "no progress for 25 s" in verdict.message
    assert "GRPO step 7: done" in verdict.message
    # A later verdict of the same process (its collective broke when a peer was killed)
    # still says it stalled; progress clears it.
    later = live.marked(termination.Verdict(1, "RuntimeError: connection reset", 1))
    assert later.stalled and later.message.startswith(verdict.message)
    assert later.message.endswith("; then RuntimeError: connection reset")
    live.beat("GRPO step 8: started")
    assert not live.stalled and verdict_in(log) is None
    assert not live.marked(termination.Verdict(1, "boom", 1)).stalled


def test_the_watch_declares_a_stall_without_a_probe_asking(log):
    live = Liveness(0.3, rank=0, environ=log)
    live.begin()
    watch = Watch(live, watch_interval(0.3))
    try:
        deadline = time.monotonic() + 5
        while not live.stalled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.stalled
        assert verdict_in(log).stalled
    finally:
        watch.close()


def test_waiting_for_rank_0_is_not_judged_and_other_threads_do_not_count(log):
    clock = Clock()
    live = Liveness(20, rank=1, clock=clock, environ=log)
    live.begin()
    with live.waiting("waiting for rank 0"):
        clock.now += 500  # rank 0 generating or evaluating meanwhile: its own probe judges
        state = live.check()
        assert state.alive and state.waiting == "waiting for rank 0"
    assert live.check().alive and live.state().idle_s == 0  # the wait ended: progress
    helper = threading.Thread(target=live.beat, args=("an upload thread",))
    clock.now += 21
    helper.start()
    helper.join()
    assert not live.check().alive  # only the loop's own thread is progress


def test_a_wait_that_broke_is_no_progress_and_a_finished_rank_is_not_judged(log):
    clock = Clock()
    live = Liveness(20, rank=1, clock=clock, environ=log)
    live.begin()
    clock.now += 5
    with pytest.raises(RuntimeError), live.waiting("waiting for rank 0"):
        raise RuntimeError("Connection closed by peer")  # rank 0 was killed
    assert live.state().idle_s == 5
    live.end()  # its verdict is written: a peer slow to reach the last barrier is fine
    clock.now += 100
    assert live.check().alive and not live.stalled


def test_a_stall_declared_as_the_rank_finishes_does_not_overwrite_its_verdict(log, monkeypatch):
    """The watch found the rank idle and was writing its stalled verdict when the main
    thread wrote the final one and ended: the stall landed last, and a completed job read
    as a failure. Judging now ends first, waiting for a stall under way, and the final
    verdict, written after, carries it."""
    clock = Clock()
    live = Liveness(20, rank=0, clock=clock, environ=log)
    live.begin()
    clock.now += 100  # idle past its timeout
    real_write, in_write = termination.write, threading.Event()

    def slow_write(verdict, environ=None):
        in_write.set()
        time.sleep(0.3)  # the main thread finishes meanwhile
        real_write(verdict, environ)

    monkeypatch.setattr(termination, "write", slow_write)
    watch = threading.Thread(target=live.check)
    watch.start()
    assert in_write.wait(5)
    monkeypatch.setattr(termination, "write", real_write)
    live.end()  # as `rlft train` does: end, then the final verdict
    final = termination.Verdict(0, "", rank=0, completed=True, step=9)
    termination.write(live.marked(final), log)
    watch.join(5)
    verdict = termination.read(Path(log[termination.ENV]).read_text())
    assert verdict is not None and verdict.completed and verdict.step == 9


def test_off_means_always_live(log):
    clock = Clock()
    live = Liveness(0, clock=clock, environ=log)
    live.begin()
    clock.now += 10**6
    assert live.check().alive and not live.stalled


@pytest.mark.parametrize(("pod_ip", "url"), [("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")])
def test_start_serves_only_on_local_rank_0_with_the_operators_port(log, pod_ip, url):
    """...at the pod's address, IPv6 on an IPv6-only cluster (the endpoint used to fail
    to bind one, and the rank with it)."""
    env = {liveness.PORT_ENV: "0", "LOCAL_RANK": "0", "RLFT_POD_IP": pod_ip, **log}
    running = start(30, 0, env)
    try:
        assert running.server is not None and running.watch is not None
        assert running.server.url.startswith(f"http://{url}:")
        assert get(running.server.url)[0] == 200
    finally:
        running.close()
    running = start(30, 3, {**env, "LOCAL_RANK": "1"})
    assert running.server is None and running.watch is not None
    running.close()
    assert start(0, 0, env).server is None  # off: nothing probes it


# ------------------------------------------------------ slow but alive keeps beating


def test_a_retried_storage_call_beats_on_each_attempt(installed):
    attempts = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise StorageError("store down", transient=True)
        return "ok"

    installed.now += 59
    slept: list[float] = []
    assert with_retries(flaky, deadline_s=60, sleep=slept.append, clock=lambda: 0) == "ok"
    state = liveness.current().state()
    assert state.last == "retrying a storage call (attempt 2)" and state.idle_s == 0


def test_waiting_for_a_checkpoint_in_flight_beats_until_its_retry_deadline(installed):
    upload = threading.Thread(target=time.sleep, args=(1.5,))
    upload.start()
    job = SimpleNamespace(step=12, deadline=time.monotonic() + 600)
    saver = SimpleNamespace(_thread=upload, _job=job)
    installed.now += 59
    assert Checkpointer.wait(saver)
    assert liveness.current().state().last == "waiting for the checkpoint of step 12"
    stuck = threading.Thread(target=time.sleep, args=(1.5,))
    stuck.start()
    job = SimpleNamespace(step=14, deadline=time.monotonic() - 1)
    past = SimpleNamespace(_thread=stuck, _job=job)
    installed.now += 59
    assert Checkpointer.wait(past)  # past its deadline the upload is stuck, not slow
    assert liveness.current().state().idle_s == 59


def test_waiting_for_rollouts_beats_only_while_completions_arrive(installed):
    tokens = [0]
    # The wait read the count before the answer came, and after it.
    reads = [threading.Event(), threading.Event()]
    pipeline = RolloutPipeline.__new__(RolloutPipeline)  # only what the wait reads
    pipeline._queue = queue.Queue()

    def read_tokens() -> int:
        value = tokens[0]
        reads[1 if value else 0].set()
        return value

    pipeline.tokens = read_tokens

    def generate() -> None:
        # In step with the wait, not with sleeps a loaded machine may outlast.
        assert reads[0].wait(30)  # the wait noted the count
        tokens[0] += 40  # a request answered
        assert reads[1].wait(30)  # the wait saw the new count (its 1 s poll)
        pipeline._queue.put("batch")

    threading.Thread(target=generate).start()
    installed.now += 59
    assert pipeline._wait_for_batch() == "batch"
    assert liveness.current().state().last == "waiting for rollouts: completions arriving"
    installed.now += 59
    threading.Thread(target=lambda: (time.sleep(1.2), pipeline._queue.put("next"))).start()
    assert pipeline._wait_for_batch() == "next"  # no tokens: a hung weight sync, say
    assert liveness.current().state().idle_s == 59


def test_evaluation_beats_per_batch(installed):
    class Engine:
        def generate(self, prompts, n, sampling):
            return [Completion(0, [1], [0.0], "stop", 0) for _ in prompts]

    problems = [SimpleNamespace(prompt="1+1=", answer="2") for _ in range(300)]
    installed.now += 59
    greedy_accuracy(Engine(), problems, lambda p: [1], lambda ids: "2", 4)
    assert liveness.current().state().last == "evaluating: problem 257 of 300"


# --------------------------------------------------------------- the planted hang


def test_a_planted_hang_is_for_one_rank_step_and_gang_attempt():
    planted = faults.planted_from_env(
        {faults.ENV: json.dumps([{"kind": "hang", "rank": 1, "at": 8}])}
    )
    assert planted == [faults.Hang(1, 8, 0)]
    assert faults.planted_hang(planted, 1, 8, {}) == faults.Hang(1, 8, 0)
    assert faults.planted_hang(planted, 1, 8, {faults.GANG_ENV: "0"}) is not None
    assert faults.planted_hang(planted, 1, 8, {faults.GANG_ENV: "1"}) is None  # restarted
    assert faults.planted_hang(planted, 0, 8, {}) is None
    assert faults.planted_hang(planted, 1, 7, {}) is None
    mixed = [{"kind": "grad_scale", "from": 2, "to": 3, "factor": 10}]
    mixed.append({"kind": "hang", "rank": 0, "at": 5, "attempt": 2})
    assert faults.planted_from_env({faults.ENV: json.dumps(mixed)})[1] == faults.Hang(0, 5, 2)
    with pytest.raises(ValueError, match="RLFT_PLANT_FAULTS"):
        faults.planted_from_env({faults.ENV: '[{"kind": "freeze"}]'})


def test_a_planted_pause_comes_after_its_steps_at_its_world_size_and_beats(monkeypatch):
    """The elastic cluster test's drill: it must beat (a rank that stops beating is
    killed as stalled), end when the rank is asked to stop (torchrun's SIGTERM as the
    gang grows) and at its limit if nothing does."""
    planted = faults.planted_from_env(
        {faults.ENV: '[{"kind": "pause", "worldSize": 2, "after": 2, "limitSeconds": 1.5}]'}
    )
    assert planted == [faults.Pause(2, 2, 1.5)]
    monkeypatch.setattr(faults, "_steps_run", 0)
    beats: list[str] = []
    monkeypatch.setattr(liveness, "beat", beats.append)
    faults.pause_if_planted(planted, 3, 0, 1)  # another world size: never
    faults.pause_if_planted(planted, 2, 0, 2)
    assert beats == []
    started = time.monotonic()
    faults.pause_if_planted(planted, 2, 0, 3)  # the third step this process runs
    assert 1.5 <= time.monotonic() - started < 30 and beats[0] == "planted pause at step 3"
    paused = len(beats)
    faults.pause_if_planted(planted, 2, 0, 4)  # once only
    assert len(beats) == paused
    monkeypatch.setattr(faults, "_steps_run", 2)  # the next step pauses
    asked = iter([False, True])
    started = time.monotonic()
    faults.pause_if_planted([faults.Pause(2, 2, 60)], 2, 0, 3, lambda: next(asked))
    assert time.monotonic() - started < 30 and len(beats) == paused + 1  # asked to stop


def test_a_rollout_server_is_started_before_it_has_weights():
    """Its startup probe asks /livez (serving at all), its readiness probe /healthz (503
    until weights are loaded: a job whose trainer builds the model has none before the
    trainer's first publication)."""
    from rlft.trainer.rollout.server import start_server

    server = start_server("transformers")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert get(f"{url}/livez") == (200, {"ok": True, "engine": "transformers"})
        code, body = get(f"{url}/healthz")
        assert code == 503 and body["reason"] == "no weights loaded yet"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@pytest.mark.parametrize(("rank", "judged"), [(1, False), (0, True)])
def test_the_end_of_step_vote_waits_for_rank_0_unjudged_on_other_ranks(
    installed, monkeypatch, rank, judged
):
    """Every rank votes on saving and stopping after each step; ranks ≥ 1 wait there for
    rank 0 to end its step (an evaluation, a weight publication), which rank 0's own
    liveness judges: a long evaluation used to make every other rank stalled."""
    from rlft.trainer.checkpoint import saver as saver_module

    seen = []

    def slow_vote(flags, op=None, group=None):  # rank 0 evaluates meanwhile
        installed.now += 61
        seen.append(liveness.current().state())

    monkeypatch.setattr(saver_module.dist, "all_reduce", slow_vote)
    liveness.begin()  # the loop runs: ranks are judged
    checkpointer = object.__new__(Checkpointer)
    checkpointer.__dict__.update(
        policy=SimpleNamespace(due=lambda step: False),
        _thread=None,
        distributed=True,
        rank=rank,
        _control=None,
        fence=None,
        superseded=None,
    )
    assert not checkpointer.poll(7).save
    assert seen[0].alive is not judged
