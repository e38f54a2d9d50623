"""What feeds each step of the loop: scored rollouts (grpo, rloo, reinforce++, ppo),
preference pairs (dpo) or supervised examples (sft, and the warm start before RL).

A source makes the step's batch on rank 0 (the loop broadcasts it) and says what it
knows about the step before the update (the record's rollout figures). Its registry
entry names which source an algorithm uses (`algorithms.registry`).
"""

from __future__ import annotations

import functools
import math
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rlft.trainer.algorithms import dpo
from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.algorithms.registry import Algorithm
from rlft.trainer.rollout.batches import (
    preference_batch,
    reference_logprobs,
    rl_batch,
    supervised_batch,
)
from rlft.trainer.rollout.engine import SamplingParams
from rlft.trainer.rollout.pipeline import StopWaiting, rollout_producer
from rlft.trainer.run.step_metrics import data_digest, rollout_metrics

if TYPE_CHECKING:
    from rlft.trainer.run.loop import Run


@dataclass
class Drawn:
    """One step's input, on rank 0."""

    batch: SequenceBatch | None
    """None: nothing trainable this step (the update is skipped)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Record fields known before the update (the guard sees them)."""
    waited_s: float = 0.0
    """Seconds the trainer waited for generation (the rest of making the batch is
    trainer work)."""
    flow: dict[str, float] = field(default_factory=dict)
    """The rollout pipeline's figures for the step."""
    phases: list[tuple[str, int, int]] = field(default_factory=list)
    """(phase, start ns, end ns) of the generation and scoring behind the batch."""
    data_digest: str | None = None
    """Which prompts the step trained on (`step_metrics.data_digest`), for the record."""


class BatchSource(Protocol):
    def start(self, run: Run) -> None:
        """Before the first step, on every rank."""

    def next(self, run: Run, step: int) -> Drawn:
        """The batch of `step` (rank 0 only)."""

    def step_done(self, run: Run) -> None:
        """After the update: the cursor holds the new version (every rank)."""

    def rolled_back(self, run: Run) -> None:
        """After a rollback restored older weights (every rank)."""

    def step_metrics(self, drawn: Drawn, step_seconds: float) -> dict[str, float]:
        """The source's own figures for the step's record (rank 0)."""

    def describe(self, record: dict[str, Any]) -> str:
        """The progress line's text for a step record."""

    def summary(self, run: Run) -> dict[str, float]:
        """Figures for summary.json after the last step (every rank)."""

    def close(self) -> None: ...


class _Source:
    """Defaults: nothing to start, publish, restart, add or summarise."""

    def start(self, run: Run) -> None:
        return None

    def step_done(self, run: Run) -> None:
        return None

    def rolled_back(self, run: Run) -> None:
        return None

    def step_metrics(self, drawn: Drawn, step_seconds: float) -> dict[str, float]:
        return {}

    def describe(self, record: dict[str, Any]) -> str:
        return f"loss {record.get('loss', float('nan')):.4f}"

    def summary(self, run: Run) -> dict[str, float]:
        return {}

    def close(self) -> None:
        return None


class ExampleSource(_Source):
    """Prompt + reference answer for supervised steps, drawn from `rng` (the cursor's
    data stream, or the warm start's own)."""

    def __init__(self, per_step: int, rng: random.Random | None = None):
        self.per_step = per_step
        self.rng = rng

    def next(self, run: Run, step: int) -> Drawn:
        rng = self.rng or run.cursor.rng
        problems = [run.task.train_problem(rng) for _ in range(self.per_step)]
        encoder = run.encoder
        return Drawn(supervised_batch(problems, encoder.prompt, encoder.answer, encoder.pad_id))


class PairSource(_Source):
    """DPO's (chosen, rejected) pairs with the reference's log-probs; held-out pair
    accuracy before the first step and after the last."""

    START = "eval_preference_accuracy_start"

    def start(self, run: Run) -> None:
        if self.START not in run.cursor.results:
            run.cursor.results[self.START] = held_out_preferences(run)

    def next(self, run: Run, step: int) -> Drawn:
        rng = run.cursor.rng
        spec = run.spec
        problems = [run.task.train_problem(rng) for _ in range(spec.algorithm.dpo.pairs_per_step)]
        encoder = run.encoder
        batch = preference_batch(problems, encoder.prompt, encoder.answer, encoder.pad_id, rng)
        digest = data_digest([problem.prompt for problem in problems])
        # At DPO's temperature, not the rollout sampler's: the loss takes the policy's
        # log-probs at it, and the margin compares the two.
        ref_logp = run.reference_logprobs(batch, dpo.TEMPERATURE)
        return Drawn(batch.with_fields(ref_logp=ref_logp), data_digest=digest)

    def describe(self, record: dict[str, Any]) -> str:
        return (
            f"loss {record['loss']:.4f} margin {record['margin_mean']:+.3f} "
            f"pair acc {record['preference_accuracy']:.2f}"
        )

    def summary(self, run: Run) -> dict[str, float]:
        return {
            self.START: run.cursor.results[self.START],
            "eval_preference_accuracy_final": held_out_preferences(run),
        }


def held_out_preferences(run: Run) -> float:
    """Share of held-out pairs whose chosen answer the policy finds more likely than the
    rejected one (summed log-probs), on rank 0; NaN without held-out problems (a jsonl
    source without its optional eval file), as the held-out accuracy is."""
    run.learner.refresh_engine_model()
    value = None
    if run.dist.is_main:
        problems = run.task.eval_problems()[: min(256, run.spec.eval.max_problems)]
        value = _preference_accuracy(run, problems) if problems else math.nan
    return run.dist.broadcast(value)


def _preference_accuracy(run: Run, problems: list) -> float:
    encoder = run.encoder
    batch = preference_batch(
        problems, encoder.prompt, encoder.answer, encoder.pad_id, random.Random(12345)
    )
    logp = reference_logprobs(
        run.learner.engine_model, batch, dpo.TEMPERATURE, run.spec.trainer.micro_batch_size
    )
    total = (logp * batch.mask).sum(-1)
    return (total[0::2] > total[1::2]).float().mean().item()


class RolloutSource(_Source):
    """Scored rollouts from the rollout pipeline (in process, or rollout servers running
    up to maxStaleness versions ahead), shaped into the algorithm's batch."""

    def __init__(self) -> None:
        self.session = None
        self.stopped: StopWaiting | None = None
        """SIGTERM came while the rollout servers were awaited: the first step stops."""

    def start(self, run: Run) -> None:
        if run.main is None:
            return
        from rlft.trainer.rollout.session import RolloutSession

        spec = run.spec
        sampling = spec.rollout.sampling
        producer = functools.partial(
            rollout_producer,
            task=run.task,
            encoder=run.encoder,
            rewards=run.main.rewards,
            algorithm=spec.algorithm,
            prompts_per_step=spec.trainer.prompts_per_step,
            sampling=SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens),
        )
        try:
            self.session = RolloutSession.start(
                run.job,
                producer,
                run.main.engine,
                run.learner.engine_model,
                run.cursor,
                run.out,
                run.reporter.log,
                run.checkpoints.stopping,
            )
        except StopWaiting as stopped:
            # Stopped by the first step's draw, with every rank (loop._draw): a deleted
            # job's rollout pods may never answer, and its grace would run out waiting.
            self.stopped = stopped
            return
        # The session may have moved the version past ones an earlier run published.
        run.set_policy_version(run.cursor.policy_version)
        if self.session.client is not None:
            run.supervisor.watch_engines(self.session.client)

    def next(self, run: Run, step: int) -> Drawn:
        if self.stopped is not None:
            raise self.stopped
        started = time.perf_counter()
        stopping = run.checkpoints.stopping
        rollouts, flow = self.session.pipeline.next(run.cursor.policy_version, stopping)
        waited = time.perf_counter() - started
        if rollouts is None:
            return Drawn(None, waited_s=waited, flow=flow)
        spec = run.spec
        reference = run.reference_logprobs if run.learner.reference is not None else None
        batch = rl_batch(
            spec.algorithm,
            rollouts,
            run.encoder.pad_id,
            spec.rollout.sampling.max_new_tokens,
            reference,
        )
        digest = data_digest(rollouts.prompt_ids)
        return Drawn(batch, rollout_metrics(rollouts), waited, flow, rollouts.phases, digest)

    def step_done(self, run: Run) -> None:
        run.learner.refresh_engine_model()  # the next batch is sampled from the new weights
        if self.session is not None:
            self.session.step_done(run.learner.engine_model, run.cursor)

    def rolled_back(self, run: Run) -> None:
        if self.session is not None:
            self.session.rolled_back(run.learner.engine_model, run.cursor)

    def step_metrics(self, drawn: Drawn, step_seconds: float) -> dict[str, float]:
        return self.session.step_metrics(drawn.flow, step_seconds)

    def describe(self, record: dict[str, Any]) -> str:
        nan = float("nan")
        accuracy = record.get("train_accuracy", nan)
        return (
            f"reward {record.get('reward_mean', nan):.3f} "
            # A job whose rewards hold no exact_match term has no accuracy to show.
            + ("" if math.isnan(accuracy) else f"acc {accuracy:.2f} ")
            + f"loss {record.get('loss', nan):+.4f} "
            f"gnorm {record.get('grad_norm', nan):.3f}"
        )

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


def source_for(entry: Algorithm, run: Run) -> BatchSource:
    """The source the algorithm's registry entry names."""
    if entry.source == "rollouts":
        return RolloutSource()
    if entry.source == "pairs":
        return PairSource()
    return ExampleSource(run.spec.trainer.prompts_per_step)
