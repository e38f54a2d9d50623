"""The async rollout pipeline on trainer rank 0: rollouts for step s are generated while
the trainer works on earlier steps, at most `spec.rollout.maxStaleness` policy versions
behind; every sample is checked again by the staleness gate before it is trained on.

`produce` is the orchestrator's own sampling (`collect` over `sample_and_score`), run
against any engine with the in-process engine's `generate` signature (the in-process
transformers engine, or `RemoteEngine` over rollout servers). With maxStaleness 0 and
the in-process engine nothing runs on a thread and batches are exactly those of the
synchronous loop.

State for checkpoints (`state_dict`): batches consumed, and the data RNG and sampling
generator as they were when the oldest batch not yet trained on began; batches in flight
are regenerated after a resume (same prompts and seeds, the resumed policy).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlft.trainer.checkpoint.rng import (
    copy_streams,
    generator_state,
    random_state,
    set_generator_state,
    set_random_state,
)
from rlft.trainer.rollout.batches import Rollouts, collect, sample_and_score, select_groups
from rlft.trainer.rollout.engine import SamplingParams
from rlft.trainer.rollout.staleness import Releases, gate, may_start, required_step
from rlft.trainer.telemetry import liveness

Produce = Callable[[random.Random, torch.Generator], Rollouts]


class StopWaiting(Exception):
    """SIGTERM came while the trainer waited for a batch, or for the rollout servers to
    start: they may be stopping too (a suspend deletes every pod of the job at once), so
    the batch may never come. The trainer checkpoints the step it finished instead of
    waiting out its grace."""


def never() -> bool:
    return False


def rollout_producer(
    engine, task, encoder, rewards, algorithm, prompts_per_step: int, sampling: SamplingParams
) -> Produce:
    """The orchestrator's sampling for one step (what the synchronous loop did inline)."""

    def produce(rng: random.Random, generator: torch.Generator) -> Rollouts:
        def sample(problems):
            return sample_and_score(
                engine,
                problems,
                encoder.prompt,
                encoder.decode,
                rewards,
                algorithm.group_size,
                sampling,
                generator,
            )

        return collect(
            lambda n: [task.train_problem(rng) for _ in range(n)],
            sample,
            prompts_per_step,
            algorithm.group_size,
            algorithm.dynamic_sampling.enabled,
            algorithm.dynamic_sampling.max_rounds,
        )

    return produce


def group_versions(rollouts: Rollouts) -> list[int]:
    """The oldest policy version in each group (one request makes a group: one version)."""
    versions: dict[int, int] = {}
    for c in rollouts.completions:
        versions[c.prompt_index] = min(
            versions.get(c.prompt_index, c.policy_version), c.policy_version
        )
    return [versions[i] for i in range(len(rollouts.prompt_ids))]


def apply_gate(
    rollouts: Rollouts, trainer_version: int, max_staleness: int, group_size: int
) -> tuple[Rollouts, dict[str, float]]:
    """Drop groups older than `max_staleness`; the staleness statistics of what is kept."""
    versions = group_versions(rollouts)
    result = gate(versions, trainer_version, max_staleness)
    stats = {
        "staleness_mean": result.staleness_mean,
        "staleness_max": float(result.staleness_max),
        "stale_dropped": float(len(result.dropped) * group_size),
    }
    if result.dropped:
        rollouts = select_groups(rollouts, result.keep, group_size)
    return rollouts, stats


@dataclass
class Produced:
    index: int
    rollouts: Rollouts
    seconds: float
    tokens: int
    start_state: dict[str, Any] = field(default_factory=dict)


class RolloutPipeline:
    def __init__(
        self,
        produce: Produce,
        rng: random.Random,
        generator: torch.Generator,
        max_staleness: int,
        group_size: int,
        threaded: bool,
        wait_published: Callable[[int], None] | None = None,
        tokens: Callable[[], int] | None = None,
    ):
        if max_staleness and not threaded:
            raise ValueError("maxStaleness > 0 needs rollout servers (the threaded pipeline)")
        if threaded:  # it draws ahead of the trainer: its own copies of the streams
            rng, generator = copy_streams(rng, generator)
        self.produce, self.rng, self.generator = produce, rng, generator
        self.max_staleness, self.group_size, self.threaded = max_staleness, group_size, threaded
        self.wait_published = wait_published or (lambda version: None)
        self.tokens = tokens or (lambda: 0)
        self._cond = threading.Condition()
        self._released = Releases(max_staleness)
        """Policy version published after each finished step."""
        self._queue: queue.Queue[Produced | BaseException] = queue.Queue()
        self._produced: list[Produced] = []
        """Batches produced and not yet consumed (for state_dict)."""
        self.consumed = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._base = 0
        self._in_progress: dict[str, Any] | None = None
        self._floor_version: int | None = None
        """Version every batch waits for when no step's release applies (after a
        rollback: the restored weights)."""

    # ------------------------------------------------------------------ state
    def _snapshot(self) -> dict[str, Any]:
        return {"rng": random_state(self.rng), "generator": generator_state(self.generator)}

    def state_dict(self) -> dict[str, Any]:
        """JSON-able: cursor, RNG states at the oldest untrained batch, what is in flight."""
        with self._cond:
            pending = list(self._produced)
            if pending:
                start = pending[0].start_state
            elif self.threaded and self._in_progress is not None:
                start = self._in_progress
            else:
                start = self._snapshot()
            return {
                "batches_consumed": self.consumed,
                "max_staleness": self.max_staleness,
                **start,
                "in_flight": [
                    {"index": p.index, "versions": sorted(set(group_versions(p.rollouts)))}
                    for p in pending
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("load the pipeline's state before it starts")
        self.consumed = int(state["batches_consumed"])
        set_random_state(self.rng, state["rng"])
        set_generator_state(self.generator, state["generator"])

    # ---------------------------------------------------------------- produce
    def _produce(self, index: int) -> Produced:
        with self._cond:
            start_state = self._snapshot()
            self._in_progress = start_state
        tokens_before, started = self.tokens(), time.perf_counter()
        rollouts = self.produce(self.rng, self.generator)
        return Produced(
            index,
            rollouts,
            time.perf_counter() - started,
            self.tokens() - tokens_before,
            start_state,
        )

    def start(self) -> None:
        if self.threaded and self._thread is None:
            self._base = self.consumed  # step numbering of this run starts here
            self._thread = threading.Thread(target=self._run, name="rollout-pipeline", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        index = self.consumed
        try:
            while True:
                with self._cond:
                    while not self._stopped and not may_start(
                        index - self._base, len(self._released), self.max_staleness
                    ):
                        self._cond.wait()
                    if self._stopped:
                        return
                    need = required_step(index - self._base, self.max_staleness)
                    version = self._released[need] if need is not None else self._floor_version
                if version is not None:
                    self.wait_published(version)
                    with self._cond:
                        if self._stopped:  # replaced (a rollback) while it waited
                            return
                produced = self._produce(index)
                with self._cond:
                    self._produced.append(produced)
                    self._in_progress = None
                self._queue.put(produced)
                index += 1
        except BaseException as error:  # surfaced to the trainer on its next batch
            self._queue.put(error)

    # ---------------------------------------------------------------- consume
    def next(
        self, trainer_version: int, stopping: Callable[[], bool] = never
    ) -> tuple[Rollouts | None, dict[str, float]]:
        """The next step's rollouts after the staleness gate (None: nothing trainable),
        with the step's rollout statistics. StopWaiting when `stopping()` turns true
        before the batch is there (checked every second), or when generation failed
        after it did (the servers were stopped with the trainer)."""
        waited = time.perf_counter()
        if self.threaded:
            self.start()
            item = self._wait_for_batch(stopping)
            if isinstance(item, BaseException):
                if stopping():
                    raise StopWaiting(f"rollout generation failed while stopping: {item}")
                # The error itself, as generating in this thread would raise it: its
                # type is the exit code (a reward's RewardError is the job's, exit 2; a
                # RuntimeError wrapping it was exit 1, restarted forever).
                item.add_note("raised in the rollout pipeline's thread")
                raise item
            produced = item
        else:
            produced = self._produce(self.consumed)
        waited = time.perf_counter() - waited
        with self._cond:
            if self._produced and self._produced[0] is produced:
                self._produced.pop(0)
            self.consumed += 1
        rollouts, stats = apply_gate(
            produced.rollouts, trainer_version, self.max_staleness, self.group_size
        )
        stats |= {
            "rollout_wait_s": waited,
            "batch_gen_s": produced.seconds,
            "gen_tokens_per_s": produced.tokens / produced.seconds if produced.seconds > 0 else 0.0,
        }
        return (rollouts if rollouts.completions else None), stats

    def _wait_for_batch(self, stopping: Callable[[], bool] = never) -> Produced | BaseException:
        """The next batch from the thread. Completions arriving meanwhile are progress
        (liveness); a wait for weights that never ship (a hung weight sync) is not."""
        seen = self.tokens()
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if stopping():
                    raise StopWaiting("stopping while waiting for rollouts") from None
                tokens = self.tokens()
                if tokens != seen:
                    seen = tokens
                    liveness.beat("waiting for rollouts: completions arriving")

    def step_done(self, version: int) -> None:
        """The trainer finished a step; `version` is what it published after it."""
        with self._cond:
            self._released.append(version)
            self._cond.notify_all()

    def restarted(
        self, rng: random.Random, generator: torch.Generator, version: int
    ) -> RolloutPipeline:
        """A pipeline that goes on from this one's batch count from the given RNG states,
        generating nothing before `version` is published: after a rollback, what this one
        generated or has in flight came from abandoned weights."""
        fresh = RolloutPipeline(
            self.produce,
            rng,
            generator,
            self.max_staleness,
            self.group_size,
            self.threaded,
            self.wait_published,
            self.tokens,
        )
        fresh.consumed = self.consumed
        fresh._floor_version = version
        return fresh

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
