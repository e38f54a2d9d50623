"""The staleness gate and the pipeline's start rule: property tests over arbitrary
interleavings of generation, training and failed weight updates, plus the pipeline on the
in-process engine (synchronous: exactly the orchestrator's own batches)."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlft.trainer.rollout.batches import Rollouts, collect
from rlft.trainer.rollout.engine import Completion
from rlft.trainer.rollout.pipeline import (
    RolloutPipeline,
    StopWaiting,
    apply_gate,
    select_groups,
)
from rlft.trainer.rollout.staleness import (
    FutureVersionError,
    Releases,
    gate,
    may_start,
    required_step,
)


@given(
    versions=st.lists(st.integers(0, 50), max_size=40),
    extra=st.integers(0, 20),
    k=st.integers(0, 8),
)
def test_gate_never_keeps_a_sample_older_than_max_staleness(versions, extra, k) -> None:
    trainer = max(versions, default=0) + extra
    result = gate(versions, trainer, k)
    assert sorted(result.keep + result.dropped) == list(range(len(versions)))
    assert result.keep == sorted(result.keep)  # order preserved
    assert all(trainer - versions[i] <= k for i in result.keep)
    assert all(trainer - versions[i] > k for i in result.dropped)
    assert result.staleness == [trainer - versions[i] for i in result.keep]
    assert result.staleness_max <= k


def test_gate_rejects_versions_from_the_future_and_negative_limits() -> None:
    with pytest.raises(FutureVersionError, match="newer than the trainer") as raised:
        gate([3], 2, 1)
    # Not a ValueError: the trainer exits 2 (a bad job, never restarted) on those.
    assert not isinstance(raised.value, ValueError)
    with pytest.raises(ValueError, match="max_staleness"):
        gate([1], 2, -1)


@given(k=st.integers(0, 6), released=st.integers(0, 30), batch=st.integers(0, 30))
@example(k=0, released=0, batch=1)  # the first batch that waits: for step 0's weights
@example(k=3, released=0, batch=4)
@example(k=3, released=0, batch=3)  # the last one that does not wait
def test_start_rule_matches_the_required_step(k, released, batch) -> None:
    need = required_step(batch, k)
    # steps 0 .. batch - k - 1 must have finished: the last of them is the one waited for
    assert need == (batch - k - 1 if batch > k else None)
    assert may_start(batch, released, k) == (need is None or released > need)


@pytest.mark.parametrize("arguments", [(-1, 0, 0), (0, -1, 0), (0, 0, -1)])
def test_the_start_rule_refuses_negative_numbers(arguments) -> None:
    with pytest.raises(ValueError, match="must be ≥ 0"):
        may_start(*arguments)


@settings(max_examples=300)
@given(
    k=st.integers(0, 4),
    steps=st.integers(1, 25),
    schedule=st.lists(st.booleans(), min_size=200, max_size=200),
    lost_updates=st.sets(st.integers(0, 25), max_size=6),
)
def test_simulated_pipeline_trains_nothing_too_stale(k, steps, schedule, lost_updates) -> None:
    """A producer that generates whenever the start rule allows, a trainer that trains
    whenever a batch is ready, in an arbitrary interleaving; an instance that misses
    some weight updates keeps serving its old version. Whatever happens, every trained
    sample passed the gate, so none is older than k; without lost updates none is
    dropped either (the start rule alone keeps the lag within k)."""
    version, served = 0, 0
    produced: list[int] = []  # version that generated each batch
    released, trained, dropped = 0, 0, 0
    lags: list[int] = []
    ticks = iter(schedule * 10)
    while trained < steps:
        can_produce = may_start(len(produced), released, k)
        can_train = trained < len(produced)
        assert can_produce or can_train  # the rules never deadlock
        if can_produce and (next(ticks) or not can_train):
            produced.append(served)
        else:
            result = gate([produced[trained]], version, k)
            lags += result.staleness
            dropped += len(result.dropped)
            trained += 1
            version += 1
            if trained not in lost_updates:
                served = version
            released += 1
    assert all(lag <= k for lag in lags)
    if not lost_updates:
        assert dropped == 0


def _rollouts(versions: list[int], group: int) -> Rollouts:
    completions = [
        Completion(p, [p, k], [-0.1, -0.2], "stop", v)
        for p, v in enumerate(versions)
        for k in range(group)
    ]
    rewards = torch.arange(len(versions) * group, dtype=torch.float32)
    problems = [object() for _ in versions]
    return Rollouts([[p] for p in range(len(versions))], problems, completions, rewards, 0.5)


def test_apply_gate_drops_whole_stale_groups_and_reindexes() -> None:
    rollouts = _rollouts([5, 2, 4, 1], group=2)
    kept, stats = apply_gate(rollouts, trainer_version=5, max_staleness=1, group_size=2)
    assert kept.prompt_ids == [[0], [2]]
    assert [c.prompt_index for c in kept.completions] == [0, 0, 1, 1]
    assert [c.token_ids[0] for c in kept.completions] == [0, 0, 2, 2]
    assert kept.rewards.tolist() == [0, 1, 4, 5]
    assert stats == {"staleness_mean": 0.5, "staleness_max": 1.0, "stale_dropped": 4.0}
    same, _ = apply_gate(rollouts, 5, 4, 2)
    assert same is rollouts  # nothing dropped: untouched


def test_select_groups_keeps_nothing() -> None:
    empty = select_groups(_rollouts([1, 1], 3), [], 3)
    assert empty.completions == [] and empty.rewards.numel() == 0


class CountingEngine:
    """A deterministic stand-in engine: completions drawn from the generator."""

    def __init__(self):
        self.policy_version = 0

    def generate(self, prompts, n, sampling, generator=None):
        out = []
        for i, _ in enumerate(prompts):
            for _ in range(n):
                token = int(torch.randint(0, 9, (1,), generator=generator))
                out.append(Completion(i, [token], [-1.0], "stop", self.policy_version))
        return out


def _produce(engine):
    from rlft.trainer.data.task import Problem
    from rlft.trainer.rollout.batches import sample_and_score

    class Rewards:
        def score(self, texts, answers):
            from types import SimpleNamespace

            values = [float(t == a) for t, a in zip(texts, answers, strict=True)]
            return SimpleNamespace(total=values, per_term={"exact_match": values})

    def produce(rng, generator):
        def sample(problems):
            return sample_and_score(
                engine,
                problems,
                lambda p: [1, 2],
                lambda ids: str(ids[0]),
                Rewards(),
                3,
                None,
                generator,
            )

        return collect(
            lambda n: [Problem("q", str(rng.randint(0, 8))) for _ in range(n)],
            sample,
            4,
            3,
            True,
            3,
        )

    return produce


def test_synchronous_pipeline_is_exactly_the_orchestrators_collect() -> None:
    engine = CountingEngine()
    produce = _produce(engine)
    direct_rng, direct_gen = random.Random(7), torch.Generator().manual_seed(7)
    expected = [produce(direct_rng, direct_gen) for _ in range(3)]
    pipeline = RolloutPipeline(
        produce, random.Random(7), torch.Generator().manual_seed(7), 0, 3, threaded=False
    )
    for want in expected:
        got, stats = pipeline.next(trainer_version=0)
        assert got is not None
        assert [c.token_ids for c in got.completions] == [c.token_ids for c in want.completions]
        assert got.rewards.tolist() == want.rewards.tolist()
        assert stats["stale_dropped"] == 0 and stats["staleness_max"] == 0
        pipeline.step_done(0)


def test_threaded_pipeline_state_round_trips_and_replays_what_was_in_flight() -> None:
    engine = CountingEngine()
    pipeline = RolloutPipeline(
        _produce(engine), random.Random(3), torch.Generator().manual_seed(3), 2, 3, threaded=True
    )
    first, _ = pipeline.next(0)
    pipeline.step_done(0)
    state = json.loads(json.dumps(pipeline.state_dict()))  # JSON-able
    assert state["batches_consumed"] == 1 and state["max_staleness"] == 2
    upcoming, _ = pipeline.next(0)  # what a resume must regenerate
    pipeline.close()
    resumed = RolloutPipeline(  # inline replay of the same draws
        _produce(engine), random.Random(0), torch.Generator(), 0, 3, threaded=False
    )
    resumed.load_state_dict(state)
    replay, _ = resumed.next(0)
    assert [c.token_ids for c in replay.completions] == [c.token_ids for c in upcoming.completions]
    assert [c.token_ids for c in replay.completions] != [c.token_ids for c in first.completions]


def test_maxstaleness_needs_the_threaded_pipeline() -> None:
    with pytest.raises(ValueError, match="rollout servers"):
        RolloutPipeline(_produce(CountingEngine()), random.Random(), torch.Generator(), 1, 3, False)


def test_a_stop_ends_the_wait_for_a_batch_that_may_never_come() -> None:
    """SIGTERM while the trainer waits on rollout servers that stop with it (a suspend
    deletes every pod at once): StopWaiting within about a second, instead of a wait
    until the grace period kills the trainer before its emergency checkpoint."""
    released, stopping = threading.Event(), threading.Event()
    first = threading.Event()

    def produce(rng, generator):
        if first.is_set():
            released.wait()  # the rollout server is gone: no answer
            raise ConnectionError("rollout server closed the connection")
        first.set()
        return _produce(CountingEngine())(rng, generator)

    pipeline = RolloutPipeline(
        produce, random.Random(3), torch.Generator().manual_seed(3), 0, 3, threaded=True
    )
    try:
        got, _ = pipeline.next(0, stopping.is_set)
        assert got is not None  # a batch that is there is used, stop or not
        pipeline.step_done(1)
        threading.Timer(0.5, stopping.set).start()
        started = time.monotonic()
        with pytest.raises(StopWaiting, match="waiting for rollouts"):
            pipeline.next(1, stopping.is_set)
        assert time.monotonic() - started < 3.0
        released.set()  # the generation fails once its server is gone
        time.sleep(0.2)
        with pytest.raises(StopWaiting, match="generation failed while stopping"):
            pipeline.next(1, stopping.is_set)
    finally:
        released.set()
        pipeline.close()


@pytest.mark.parametrize("error", [ConnectionError("closed the connection"), "reward"])
def test_a_generation_failure_without_a_stop_is_the_error_itself(error) -> None:
    """Raised as generating in the trainer's own thread would: its type decides the exit
    code. A reward's error (the job's, exit 2) was wrapped in a RuntimeError (exit 1),
    and the operator restarted a job that could never succeed."""
    from rlft.trainer.data.rewards import RewardError

    if error == "reward":
        error = RewardError("reward 'mine:score' raised ValueError: could not convert")

    def produce(rng, generator):
        raise error

    pipeline = RolloutPipeline(
        produce, random.Random(3), torch.Generator().manual_seed(3), 0, 3, threaded=True
    )
    try:
        with pytest.raises(type(error)) as raised:
            pipeline.next(0, lambda: False)
        assert raised.value is error
        assert "raised in the rollout pipeline's thread" in raised.value.__notes__
    finally:
        pipeline.close()


def test_a_pipeline_closed_while_it_waits_for_weights_generates_nothing() -> None:
    """After a rollback the old pipeline is closed while its thread waits for a version
    of the abandoned weights; once a version that high is published (the new timeline's
    versions grow past it) it generated a whole batch nobody wanted, on servers that do
    one request at a time, ahead of the new pipeline's first batch."""
    published, waiting = threading.Event(), threading.Event()
    calls: list[int] = []

    def wait_published(version: int) -> None:
        waiting.set()
        published.wait(10)

    def produce(rng, generator):
        calls.append(1)
        return _produce(CountingEngine())(rng, generator)

    pipeline = RolloutPipeline(
        produce, random.Random(3), torch.Generator().manual_seed(3), 0, 3, True, wait_published
    )
    pipeline._floor_version = 4  # as `restarted` sets it
    pipeline.start()
    assert waiting.wait(10)

    def publish_once_closing() -> None:  # published while close() joins, not before
        deadline = time.monotonic() + 10
        while not pipeline._stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        published.set()

    threading.Thread(target=publish_once_closing, daemon=True).start()
    pipeline.close()
    thread = pipeline._thread
    thread.join(10)
    assert not thread.is_alive() and calls == []


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 5])
def test_releases_keep_every_version_the_producer_can_still_ask_for(max_staleness) -> None:
    # The pipeline's producer and trainer, interleaved at random: each batch the producer
    # starts finds the version it must wait for among the few kept, as a full list has it.
    rng = random.Random(max_staleness)
    kept, full = Releases(max_staleness), []
    produced = consumed = 0
    for _ in range(5000):
        move = rng.random()
        if move < 0.4 and may_start(produced, len(kept), max_staleness):
            need = required_step(produced, max_staleness)
            if need is not None:
                assert kept[need] == full[need]
            produced += 1
        elif move < 0.7 and consumed < produced:
            consumed += 1
        elif len(kept) < consumed:  # the trainer finished a step: its version published
            version = rng.randrange(10**6)
            kept.append(version)
            full.append(version)
    assert len(kept) == len(full) > 1000
    with pytest.raises(IndexError):
        kept[len(full) - max_staleness - 3]
