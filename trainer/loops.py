"""The step loops of a job: the supervised warm start, RL (grpo, rloo, reinforce++, ppo),
preference optimisation (dpo) and supervised training (sft).

Rank 0 makes each batch (it owns the rollout engine, the rewards and the reference
model) and broadcasts it; every rank trains on its shard through the `Learner`.
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from rlft.trainer.algorithms.objectives import Supervised, build_objective
from rlft.trainer.batch import SequenceBatch
from rlft.trainer.checkpoint import NoCheckpointError
from rlft.trainer.config import RLFineTune
from rlft.trainer.data import Problem, Task
from rlft.trainer.distributed import Dist
from rlft.trainer.encoding import Encoder
from rlft.trainer.evaluate import greedy_accuracy
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.learner import Learner, StepResult
from rlft.trainer.orchestrator import (
    preference_batch,
    reference_logprobs,
    rl_batch,
    supervised_batch,
)
from rlft.trainer.progress import Reporter
from rlft.trainer.resume import Checkpointing, Cursor
from rlft.trainer.rewards import RewardModel
from rlft.trainer.rollout import SamplingParams, TransformersEngine
from rlft.trainer.rollout.session import RolloutSession
from rlft.trainer.step_metrics import rollout_metrics, update_metrics
from rlft.trainer.supervisor import RunEnded, Supervisor


@dataclass
class Run:
    """Everything the loops share. `engine`, `rewards` and `metrics` exist on rank 0."""

    job: RLFineTune
    task: Task
    encoder: Encoder
    learner: Learner
    dist: Dist
    reporter: Reporter
    engine: TransformersEngine | None = None
    rewards: RewardModel | None = None
    metrics: IO[str] | None = None
    reference: torch.nn.Module | None = None
    cursor: Cursor | None = None
    checkpoints: Checkpointing | None = None
    supervisor: Supervisor | None = None
    out: Path | None = None
    """Output folder (local runs; rollout servers' weights and logs go below it)."""

    @property
    def spec(self):
        return self.job.spec

    def accuracy(self, problems: list[Problem]) -> float:
        assert self.engine is not None
        return greedy_accuracy(
            self.engine,
            problems,
            self.encoder.prompt,
            self.encoder.decode,
            self.spec.rollout.sampling.max_new_tokens,
        )

    def eval_accuracy(self) -> float:
        """Held-out greedy accuracy, computed on rank 0 and shared with every rank."""
        value = None
        if self.dist.is_main:
            value = self.accuracy(self.task.eval_problems()[: self.spec.eval.max_problems])
        return self.dist.broadcast(value)

    def freeze_reference(self) -> None:
        """A frozen copy of the current policy, for KL terms and DPO. Rank 0 scores with
        it; every rank holds one so that checkpoints are alike on all ranks."""
        state = self.learner.full_policy_state()
        self.reference = copy.deepcopy(self.learner.engine_model).eval()
        self.reference.load_state_dict(state)
        for parameter in self.reference.parameters():
            parameter.requires_grad_(False)

    def end_of_step(self, step: int, policy_version: int, result: StepResult | None = None):
        """Record the step in the cursor, act on the guard's decision (roll back, or end
        the run), checkpoint when due (may raise StopRequested or RunEnded)."""
        assert self.cursor is not None and self.checkpoints is not None
        self.cursor.step, self.cursor.policy_version = step, policy_version
        if result is not None and result.action == "rollback":
            self._roll_back(step)
        ended = self.supervisor.ended(step) if result is not None else None
        if ended is not None:
            if ended.code == ExitCode.OK:  # pause: keep everything for a later resume
                self.checkpoints.final(self.cursor, self.learner, self.reference)
            self.supervisor.set_phase("paused" if ended.code == ExitCode.OK else "failed")
            raise ended
        self.checkpoints.end_of_step(self.cursor, self.learner, self.reference)

    def _roll_back(self, step: int) -> None:
        before = self.supervisor.last["restore_before_step"] or step
        try:
            restored = self.checkpoints.rollback(before, self.cursor, self.learner, self.reference)
        except NoCheckpointError as error:
            raise RunEnded(f"collapse at step {step} and {error}", ExitCode.COLLAPSED) from None
        if self.engine is not None:
            self.engine.set_policy_version(self.cursor.policy_version)
        message = (
            f"step {step}: rolled back to the healthy checkpoint of step {restored}; "
            f"learning rate × {self.supervisor.lr_multiplier:g} from now on"
        )
        self.supervisor.event("rollback", message, "warning", step)

    def ref_logp(self, batch: SequenceBatch) -> torch.Tensor:
        assert self.reference is not None
        return reference_logprobs(
            self.reference,
            batch,
            self.spec.rollout.sampling.temperature,
            self.spec.trainer.micro_batch_size,
        )

    def write(self, record: dict) -> None:
        self.supervisor.record(record)
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()


def warmup_lr(step: int, warmup_steps: int, peak: float) -> float:
    """Linear warm-up over `warmup_steps`, then constant."""
    return peak * min(1.0, step / max(1, warmup_steps))


def warm_start(run: Run) -> int:
    """Supervised fine-tuning on reference answers before RL; stops early once a probe of
    fresh training problems reaches `stopAtAccuracy`. Returns the steps taken."""
    sft = run.spec.algorithm.sft
    rng, probe_rng = (
        random.Random(run.spec.trainer.seed + 1),
        random.Random(run.spec.trainer.seed + 2),
    )
    objective = Supervised(run.spec.algorithm)
    run.learner.reset_optimizer(sft.learning_rate)
    run.reporter.start("SFT warm start", sft.steps)
    for step in range(1, sft.steps + 1):
        run.learner.set_lr(warmup_lr(step, sft.warmup_steps, sft.learning_rate))
        problems = [run.task.train_problem(rng) for _ in range(sft.batch_size)]
        batch = supervised_batch(
            problems, run.encoder.prompt, run.encoder.answer, run.encoder.pad_id
        )
        result = run.learner.step(objective, batch)
        run.learner.publish()
        run.reporter.advance(step, f"loss {result.stats.get('loss', float('nan')):.3f}")
        if sft.stop_at_accuracy is not None and step % sft.probe_every_steps == 0:
            accuracy = None
            if run.dist.is_main:
                probe = [run.task.train_problem(probe_rng) for _ in range(sft.probe_problems)]
                accuracy = run.accuracy(probe)
            accuracy = run.dist.broadcast(accuracy)
            if accuracy >= sft.stop_at_accuracy:
                run.reporter.stop()
                run.reporter.log(
                    f"rlft: warm start reached {accuracy:.3f} on a probe of training problems "
                    f"after {step} steps (target {sft.stop_at_accuracy}); starting RL"
                )
                return step
    run.reporter.stop()
    return sft.steps


def _sampling(run: Run) -> SamplingParams:
    s = run.spec.rollout.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens)


def _make_rl_batch(run: Run, rollouts):
    """Rank 0: scored rollouts (from the rollout pipeline) → shaped, filtered → a training
    batch (or None)."""
    if not rollouts.completions:
        return None
    reference = run.ref_logp if run.reference is not None else None
    return rl_batch(
        run.spec.algorithm,
        rollouts,
        run.encoder.pad_id,
        run.spec.rollout.sampling.max_new_tokens,
        reference,
    )


def rl_loop(run: Run, steps: int) -> None:
    """grpo / rloo / reinforce++ / ppo."""
    spec = run.spec
    algorithm = spec.algorithm
    rng, generator = run.cursor.rng, run.cursor.generator
    objective = build_objective(
        algorithm, spec.rollout.sampling.temperature, spec.rollout.sampling.max_new_tokens
    )
    # Rank 0 gets rollouts from the pipeline: in-process (synchronous) or rollout servers
    # running up to maxStaleness steps ahead (rlft.trainer.rollout.session).
    session = (
        RolloutSession.start(run, rng, generator, _sampling(run), run.out)
        if run.dist.is_main
        else None
    )
    try:
        _rl_steps(run, steps, objective, session)
    finally:
        if session is not None:
            session.close()


def _rl_steps(run: Run, steps: int, objective, session) -> None:
    spec = run.spec
    trainer, algorithm = spec.trainer, spec.algorithm
    run.reporter.start(algorithm.name.upper(), steps)
    for step in range(run.cursor.step + 1, steps + 1):
        started = time.perf_counter()
        lr = warmup_lr(step, trainer.warmup_steps, trainer.learning_rate)
        lr *= run.supervisor.lr_multiplier
        run.learner.set_lr(lr)
        batch, rollouts, flow, base = None, None, {}, {}
        generated = started
        if run.dist.is_main:
            rollouts, flow = session.pipeline.next(run.engine.policy_version)
            # Making the batch (reference log-probs, advantages) is trainer work: it
            # counts as training time, and overlaps generation of the next batch.
            generated = time.perf_counter()
            batch = _make_rl_batch(run, rollouts)
            base = {"step": step, "policy_version": run.engine.policy_version, "lr": lr}
            base |= rollout_metrics(rollouts)
        batch = run.dist.broadcast(batch)
        if batch is None:
            result = StepResult(applied=False, reason="no informative groups were sampled")
        else:
            result = run.learner.step(
                objective, batch, algorithm.policy_loss.epochs, judge=_judge(run, base), step=step
            )
        run.learner.publish()
        if result.applied and run.engine is not None:
            run.engine.set_policy_version(run.engine.policy_version + 1)
        if session is not None:
            session.step_done(run.learner.engine_model, run.engine.policy_version, run.cursor)
        finished = time.perf_counter()
        if run.dist.is_main:
            record = {"step": step, "policy_version": run.engine.policy_version, "lr": lr}
            record |= rollout_metrics(rollouts) | update_metrics(result)
            record |= {
                "gen_time_s": generated - started,
                "train_time_s": finished - generated,
                "step_time_s": finished - started,
            }
            record |= session.step_metrics(flow, finished - started)
            if spec.eval.every_steps and step % spec.eval.every_steps == 0 and step < steps:
                record["eval_accuracy"] = run.accuracy(
                    run.task.eval_problems()[: spec.eval.max_problems]
                )
            run.write(record)
            run.reporter.advance(
                step,
                f"reward {record['reward_mean']:.3f} acc {record['train_accuracy']:.2f} "
                f"loss {record.get('loss', float('nan')):+.4f} "
                f"gnorm {record.get('grad_norm', float('nan')):.3f}",
            )
        version = run.dist.broadcast(run.engine.policy_version if run.engine else 0)
        run.end_of_step(step, version, result)
        if session is not None and result.action == "rollback":
            session.rolled_back(run.learner.engine_model, run.engine.policy_version, run.cursor)
    run.reporter.stop()


def _judge(run: Run, base: dict):
    """The learner's hook: the guard sees everything known before the optimizer step."""
    return lambda result: run.supervisor.judge(base | update_metrics(result))


def dpo_loop(run: Run, steps: int) -> dict[str, float]:
    """DPO / IPO on preference pairs; returns held-out pair accuracy before and after."""
    spec = run.spec
    trainer, dpo = spec.trainer, spec.algorithm.dpo
    rng = run.cursor.rng
    objective = build_objective(spec.algorithm, 1.0, spec.rollout.sampling.max_new_tokens)
    if "eval_preference_accuracy_start" not in run.cursor.results:
        run.cursor.results["eval_preference_accuracy_start"] = held_out_preferences(run)
    run.reporter.start("DPO", steps)
    for step in range(run.cursor.step + 1, steps + 1):
        lr = warmup_lr(step, trainer.warmup_steps, trainer.learning_rate)
        lr *= run.supervisor.lr_multiplier
        run.learner.set_lr(lr)
        batch = None
        if run.dist.is_main:
            problems = [run.task.train_problem(rng) for _ in range(dpo.pairs_per_step)]
            batch = _pairs(run, problems, rng)
        base = {"step": step, "lr": lr}
        batch = run.dist.broadcast(batch)
        result = run.learner.step(objective, batch, judge=_judge(run, base), step=step)
        run.learner.publish()
        if run.dist.is_main:
            run.engine.set_policy_version(run.engine.policy_version + 1)
            record = {"step": step, "policy_version": run.engine.policy_version, "lr": lr}
            record |= update_metrics(result)
            run.write(record)
            run.reporter.advance(
                step,
                f"loss {record['loss']:.4f} margin {record['margin_mean']:+.3f} "
                f"pair acc {record['preference_accuracy']:.2f}",
            )
        run.end_of_step(step, step, result)
    run.reporter.stop()
    return {
        "eval_preference_accuracy_start": run.cursor.results["eval_preference_accuracy_start"],
        "eval_preference_accuracy_final": held_out_preferences(run),
    }


def _pairs(run: Run, problems: list[Problem], rng: random.Random) -> SequenceBatch:
    batch = preference_batch(
        problems, run.encoder.prompt, run.encoder.answer, run.encoder.pad_id, rng
    )
    return batch.with_fields(ref_logp=run.ref_logp(batch))


def held_out_preferences(run: Run) -> float:
    """Share of held-out pairs whose chosen answer the policy finds more likely than the
    rejected one (summed log-probs), on rank 0."""
    value = None
    if run.dist.is_main:
        problems = run.task.eval_problems()[: min(256, run.spec.eval.max_problems)]
        batch = preference_batch(
            problems,
            run.encoder.prompt,
            run.encoder.answer,
            run.encoder.pad_id,
            random.Random(12345),
        )
        logp = reference_logprobs(
            run.learner.engine_model, batch, 1.0, run.spec.trainer.micro_batch_size
        )
        total = (logp * batch.mask).sum(-1)
        value = (total[0::2] > total[1::2]).float().mean().item()
    return run.dist.broadcast(value)


def sft_loop(run: Run, steps: int) -> None:
    """Supervised training as the job's algorithm (`name: sft`)."""
    spec = run.spec
    trainer = spec.trainer
    rng = run.cursor.rng
    objective = Supervised(spec.algorithm)
    run.reporter.start("SFT", steps)
    for step in range(run.cursor.step + 1, steps + 1):
        lr = warmup_lr(step, trainer.warmup_steps, trainer.learning_rate)
        lr *= run.supervisor.lr_multiplier
        run.learner.set_lr(lr)
        problems = [run.task.train_problem(rng) for _ in range(trainer.prompts_per_step)]
        batch = supervised_batch(
            problems, run.encoder.prompt, run.encoder.answer, run.encoder.pad_id
        )
        base = {"step": step, "lr": lr}
        result = run.learner.step(objective, batch, judge=_judge(run, base), step=step)
        run.learner.publish()
        if run.dist.is_main:
            run.engine.set_policy_version(run.engine.policy_version + 1)
            record = {"step": step, "policy_version": run.engine.policy_version, "lr": lr}
            run.write(record | update_metrics(result))
            run.reporter.advance(step, f"loss {result.stats.get('loss', float('nan')):.4f}")
        run.end_of_step(step, step, result)
    run.reporter.stop()
