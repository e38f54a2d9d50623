"""The phases a job runs through the one step loop: the supervised warm start, then the
job's algorithm as its registry entry describes it (objective, source, reference,
critic)."""

from __future__ import annotations

import random

from rlft.trainer.algorithms.registry import algorithm
from rlft.trainer.algorithms.sft import Supervised
from rlft.trainer.run.loop import Phase, Run
from rlft.trainer.run.sources import ExampleSource, source_for


def warm_start_phase(run: Run) -> Phase:
    """Supervised fine-tuning on reference answers before RL; stops early once a probe of
    fresh training problems reaches `stopAtAccuracy`."""
    sft = run.spec.algorithm.sft
    seed = run.spec.trainer.seed
    probe_rng = random.Random(seed + 2)

    def reached_target(step: int) -> bool:
        if sft.stop_at_accuracy is None or step % sft.probe_every_steps:
            return False
        run.learner.refresh_engine_model()
        accuracy = None
        if run.main is not None:
            probe = [run.task.train_problem(probe_rng) for _ in range(sft.probe_problems)]
            accuracy = run.accuracy(probe)
        accuracy = run.dist.broadcast(accuracy)
        if accuracy < sft.stop_at_accuracy:
            return False
        run.reporter.stop()
        run.reporter.log(
            f"rlft: warm start reached {accuracy:.3f} on a probe of training problems "
            f"after {step} steps (target {sft.stop_at_accuracy}); starting RL"
        )
        return True

    return Phase(
        "SFT warm start",
        ExampleSource(sft.batch_size, random.Random(seed + 1)),
        Supervised(run.spec.algorithm),
        sft.steps,
        sft.learning_rate,
        sft.warmup_steps,
        guarded=False,
        stop_after=reached_target,
    )


def wants_warm_start(run: Run) -> bool:
    spec = run.spec.algorithm
    return bool(spec.sft.steps) and algorithm(spec.name).source != "examples"


def prepare_main_phase(run: Run, config) -> None:
    """The main phase's optimizer, frozen reference and critic, from the current policy
    (also the shapes a checkpoint restores into)."""
    spec = run.spec.algorithm
    entry = algorithm(spec.name)
    run.learner.reset_optimizer(run.spec.trainer.learning_rate)
    if entry.needs_reference(spec):
        run.learner.freeze_reference()
    if entry.critic:
        critic = _critic_from(config, run.learner.full_policy_state())
        run.learner.attach_critic(critic, spec.ppo.value_learning_rate)


def main_phase(run: Run, steps: int) -> Phase:
    spec = run.spec
    entry = algorithm(spec.algorithm.name)
    sampling = spec.rollout.sampling
    return Phase(
        spec.algorithm.name.upper(),
        source_for(entry, run),
        entry.objective(spec.algorithm, sampling.temperature, sampling.max_new_tokens),
        steps,
        spec.trainer.learning_rate,
        spec.trainer.warmup_steps,
        first_step=run.cursor.step + 1,
        epochs=spec.algorithm.policy_loss.epochs if entry.source == "rollouts" else 1,
    )


def _critic_from(config, state):
    """Every rank builds the same critic from the policy's full weights."""
    from transformers import AutoModelForCausalLM

    from rlft.trainer.model.build import build_critic
    from rlft.trainer.model.construct import from_config

    base = from_config(AutoModelForCausalLM, config)
    base.load_state_dict(state)
    return build_critic(base)
