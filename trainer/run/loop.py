"""The one step loop of every phase of a job, on every rank:

    train(run, phase)            the warm start, then the job's algorithm
      train_step(run, phase, s)  batch from the phase's source (rank 0, broadcast) →
                                 the learner's update, judged by the guard
      finish_step(...)           the one place that acts on the result: publication,
                                 the policy version, the record, the guard's decision
                                 (rollback, pause, fail) and the checkpoint

The warm start is a phase like the others with a supervised source; it has no guard,
versions, records or checkpoints (it is rerun deterministically instead).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.checkpoint import NoCheckpointError
from rlft.trainer.config import RLFineTune
from rlft.trainer.data import Problem, Task
from rlft.trainer.data.rewards import RewardModel
from rlft.trainer.distributed import Dist
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.learner import faults
from rlft.trainer.learner.learner import Learner, StepResult
from rlft.trainer.model.encoding import Encoder
from rlft.trainer.rollout.batches import reference_logprobs
from rlft.trainer.rollout.pipeline import StopWaiting
from rlft.trainer.run.checkpointing import Checkpointing
from rlft.trainer.run.evaluate import greedy_accuracy
from rlft.trainer.run.progress import Reporter
from rlft.trainer.run.sources import BatchSource, Drawn
from rlft.trainer.run.state import Cursor
from rlft.trainer.run.step_metrics import update_metrics
from rlft.trainer.run.supervisor import RunEnded, Supervisor
from rlft.trainer.telemetry import liveness
from rlft.trainer.telemetry.tracing import StepTracer


@dataclass
class MainRank:
    """Rank 0's duties: the in-process engine (evaluation, rollouts), the rewards, and
    the metrics file."""

    engine: Any
    """The in-process TransformersEngine on the learner's unsharded policy."""
    rewards: RewardModel
    metrics: IO[str] | None = None

    def write(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()


@dataclass
class Run:
    """What every phase of a job shares, on every rank (`main` on rank 0 only)."""

    job: RLFineTune
    task: Task
    encoder: Encoder
    learner: Learner
    dist: Dist
    reporter: Reporter
    supervisor: Supervisor
    checkpoints: Checkpointing
    cursor: Cursor
    out: Path
    main: MainRank | None = None

    @property
    def spec(self):
        return self.job.spec

    @property
    def tracer(self) -> StepTracer:
        telemetry = self.supervisor.telemetry
        return telemetry.tracer if telemetry is not None else _NO_TRACER

    def accuracy(self, problems: list[Problem]) -> float:
        """Greedy exact-match accuracy of the current policy on `problems` (rank 0)."""
        assert self.main is not None
        return greedy_accuracy(
            self.main.engine,
            problems,
            self.encoder.prompt,
            self.encoder.decode,
            self.spec.rollout.sampling.max_new_tokens,
        )

    def eval_accuracy(self) -> float:
        """Held-out greedy accuracy, computed on rank 0 and shared with every rank."""
        self.learner.refresh_engine_model()
        value = None
        if self.main is not None:
            value = self.accuracy(self.task.eval_problems()[: self.spec.eval.max_problems])
        return self.dist.broadcast(value)

    def reference_logprobs(
        self, batch: SequenceBatch, temperature: float | None = None
    ) -> torch.Tensor:
        """The frozen reference's log-probs of the batch's targets at `temperature`: by
        default the rollout sampling temperature, at which the RL objectives take the
        policy's (and the engine its behaviour) log-probs, so that KL compares like with
        like. DPO, which scores at temperature 1, passes its own."""
        assert self.learner.reference is not None
        if temperature is None:
            temperature = self.spec.rollout.sampling.temperature
        return reference_logprobs(
            self.learner.reference, batch, temperature, self.spec.trainer.micro_batch_size
        )

    def set_policy_version(self, version: int) -> None:
        """The cursor owns the version; the in-process engine tags completions with it."""
        self.cursor.policy_version = version
        if self.main is not None:
            self.main.engine.set_policy_version(version)


_NO_TRACER = StepTracer()


@dataclass
class Phase:
    title: str
    source: BatchSource
    objective: Any
    steps: int
    """Number of the last step."""
    learning_rate: float
    warmup_steps: int
    first_step: int = 1
    epochs: int = 1
    guarded: bool = True
    """The job's algorithm: judged by the guard, versioned, recorded, checkpointed."""
    stop_after: Callable[[int], bool] | None = None
    """Ends the phase early after a step (every rank gets the same answer)."""


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up over `warmup_steps`, then constant: the share of the peak rate."""
    return min(1.0, step / max(1, warmup_steps))


def train(run: Run, phase: Phase) -> int:
    """Steps `first_step`..`steps` of `phase`; returns the last step taken."""
    run.reporter.start(phase.title, phase.steps)
    run.supervisor.begin(phase.guarded, run.cursor.step, run.cursor.policy_version)
    liveness.begin()  # judged from here on: what came before is the startup probe's
    phase.source.start(run)
    step = phase.first_step - 1
    try:
        for step in range(phase.first_step, phase.steps + 1):
            train_step(run, phase, step)
            if phase.stop_after is not None and phase.stop_after(step):
                break
        run.learner.refresh_engine_model()  # what comes next evaluates, samples or saves
    finally:
        run.reporter.stop()
        phase.source.close()
    return step


@dataclass
class Timings:
    """Seconds of the step's phases as the trainer saw them (perf_counter)."""

    started: float
    generated: float = 0.0
    trained: float = 0.0
    published: float = 0.0


@dataclass
class Outcome:
    """What one step produced, for `finish_step`."""

    step: int
    base: dict
    """The record fields known before the update (what the guard saw)."""
    drawn: Drawn
    result: StepResult
    timings: Timings


def train_step(run: Run, phase: Phase, step: int) -> None:
    tracer = run.tracer
    with tracer.step(step, run.cursor.policy_version, phase.title):
        liveness.beat(f"{phase.title} step {step}: started")
        timings = Timings(time.perf_counter())
        warmup, multiplier = warmup_factor(step, phase.warmup_steps), run.supervisor.lr_multiplier
        lr = phase.learning_rate * warmup * multiplier
        run.learner.set_lr(lr, warmup * multiplier)
        drawn = _draw(run, phase, step)
        if phase.guarded and run.learner.planted:  # a drill: a rank hung or failing
            faults.hang_if_planted(run.learner.planted, run.dist.rank, step)
            faults.raise_if_planted(run.learner.planted, run.dist.rank, step)
            faults.pause_if_planted(
                run.learner.planted, run.dist.world, run.dist.rank, step, run.checkpoints.stopping
            )
        batch = run.dist.broadcast(STOPPED if drawn is None else drawn.batch)
        if isinstance(batch, str):
            run.checkpoints.stop_between_steps(run.cursor, run.learner)
        assert drawn is not None
        timings.generated = timings.started + drawn.waited_s
        for name, start_ns, end_ns in drawn.phases:
            tracer.record(name, start_ns, end_ns)
        with tracer.phase("train"):
            base = {"step": step, "policy_version": run.cursor.policy_version, "lr": lr}
            base |= drawn.fields
            result = _update(run, phase, batch, base, step)
        timings.trained = time.perf_counter()
        liveness.beat(f"{phase.title} step {step}: updated")
        with tracer.phase("publish_weights"):
            if phase.guarded and result.applied:
                run.set_policy_version(run.cursor.policy_version + 1)
            phase.source.step_done(run)
        timings.published = time.perf_counter()
        finish_step(run, phase, Outcome(step, base, drawn, result, timings))


STOPPED = "stopped before the batch"
"""Broadcast instead of a batch: SIGTERM came while rank 0 waited for it."""


def _draw(run: Run, phase: Phase, step: int) -> Drawn | None:
    """The step's batch on rank 0 (an empty Drawn elsewhere); None when SIGTERM came
    while rank 0 waited for it."""
    if run.main is None:
        return Drawn(None)
    try:
        return phase.source.next(run, step)
    except StopWaiting as stopped:
        run.reporter.log(f"rlft: {stopped}; checkpointing step {run.cursor.step} instead")
        return None


def _update(run: Run, phase: Phase, batch, base: dict, step: int) -> StepResult:
    if batch is None:
        return StepResult(applied=False, reason="no informative groups were sampled")
    judge = None
    if phase.guarded:
        supervisor = run.supervisor

        def judge(result: StepResult):
            return supervisor.judge(base | update_metrics(result))

    return run.learner.step(phase.objective, batch, phase.epochs, judge=judge, step=step)


def finish_step(run: Run, phase: Phase, outcome: Outcome) -> None:
    """Record the step, act on the guard's decision, checkpoint when due. May raise
    StopRequested (SIGTERM: emergency checkpoint committed) or RunEnded."""
    step = outcome.step
    if _eval_due(run, phase, step):
        # Collective: sources without a per-step sync (DPO, SFT) left rank 0's engine
        # copy at the weights of the phase's start on several ranks.
        run.learner.refresh_engine_model()
    if run.main is not None:
        record = _record(run, phase, outcome)
        line = _progress_line(phase, record)
        if phase.guarded:
            run.supervisor.record(record)
            run.main.write(record)
        run.reporter.advance(step, line)
    if not phase.guarded:
        # SIGTERM in a warm start: nothing to save, stop now (it went on until the
        # grace's end, and the watchdog's exit 1 wrote no verdict: counted a failure).
        run.checkpoints.stop_unsaved()
        return
    run.cursor.step = step
    decision = outcome.result.decision
    if decision.action == "rollback":
        replay = decision.resume_data_after_step is None  # spec.stability.skipDataWindow
        _roll_back(run, phase, step, decision.restore_before_step or step, replay)
    ended = run.supervisor.ended(decision, step)
    if ended is not None:
        if ended.code == ExitCode.OK:  # pause: keep everything for a later resume
            run.checkpoints.final(run.cursor, run.learner, paused=True)
        run.supervisor.set_phase("paused" if ended.code == ExitCode.OK else "failed")
        raise ended
    started = time.perf_counter()
    with run.tracer.phase("checkpoint"):
        run.checkpoints.end_of_step(run.cursor, run.learner)
    run.supervisor.record({"checkpoint_time_s": time.perf_counter() - started})
    liveness.beat(f"{phase.title} step {step}: done")


def _eval_due(run: Run, phase: Phase, step: int) -> bool:
    """spec.eval.everySteps: a held-out evaluation in the record of this step (the job's
    last step's is the run's final one). A run cut short by --max-steps evaluates its
    last step too: its history is the uninterrupted run's, resumed or not."""
    every = run.spec.eval.every_steps
    return bool(phase.guarded and every and step % every == 0 and step < run.spec.trainer.steps)


def _progress_line(phase: Phase, record: dict) -> str:
    """The step's progress text, saying why its update was skipped (metrics.jsonl has
    it; the line showed only `loss nan`)."""
    skipped = record.get("skip_reason")
    if skipped and "loss" not in record:
        return f"update skipped: {skipped}"
    line = phase.source.describe(record)
    return f"{line} (update skipped: {skipped})" if skipped else line


def _record(run: Run, phase: Phase, outcome: Outcome) -> dict:
    """The step's line in metrics.jsonl (and, through the bindings, Prometheus)."""
    step, drawn, timings = outcome.step, outcome.drawn, outcome.timings
    step_seconds = timings.published - timings.started
    record = {"step": step, "policy_version": run.cursor.policy_version, "lr": outcome.base["lr"]}
    if run.learner.critic_optimizer is not None:
        record["critic_lr"] = run.learner.critic_optimizer.param_groups[0]["lr"]
    record |= drawn.fields | update_metrics(outcome.result)
    if step % run.spec.telemetry.expert_load_every_steps and step != 1:
        record.pop("expert_load", None)
    if drawn.data_digest is not None:
        record["data_digest"] = drawn.data_digest
    record |= {
        "gen_time_s": timings.generated - timings.started,
        "train_time_s": timings.trained - timings.generated,
        "publish_time_s": timings.published - timings.trained,
        "step_time_s": step_seconds,
    }
    scoring = [end - start for name, start, end in drawn.phases if name == "score"]
    if scoring:
        record["score_time_s"] = sum(scoring) / 1e9
    record |= phase.source.step_metrics(drawn, step_seconds)
    if _eval_due(run, phase, step):
        record["eval_accuracy"] = run.accuracy(
            run.task.eval_problems()[: run.spec.eval.max_problems]
        )
    return record


def _roll_back(run: Run, phase: Phase, step: int, before: int, replay: bool) -> None:
    try:
        restored = run.checkpoints.rollback(before, run.cursor, run.learner, replay)
    except NoCheckpointError as error:
        run.supervisor.set_phase("failed")  # as every other end by the guard says
        raise RunEnded(f"collapse at step {step} and {error}", ExitCode.COLLAPSED) from None
    run.supervisor.rolled_back()
    run.set_policy_version(run.cursor.policy_version)
    message = (
        f"step {step}: rolled back to the healthy checkpoint of step {restored}; "
        f"learning rate × {run.supervisor.lr_multiplier:g} from now on"
    )
    run.supervisor.event("rollback", message, "warning", step)
    phase.source.rolled_back(run)
