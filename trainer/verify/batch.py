"""The small batch `rlft verify` checks: real rollouts of the job's own model and task."""

from __future__ import annotations

import random

import torch

from rlft.trainer.algorithms import dpo
from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.algorithms.objectives import Models
from rlft.trainer.algorithms.registry import algorithm as registered
from rlft.trainer.config import RLFineTune
from rlft.trainer.model.build import build_critic, float32_norms, to_float64
from rlft.trainer.rollout import SamplingParams, TransformersEngine
from rlft.trainer.rollout.batches import (
    preference_batch,
    reference_logprobs,
    rl_batch,
    sample_and_score,
    supervised_batch,
)
from rlft.trainer.run.parts import build_parts


def verification_batch(
    job: RLFineTune, sequences: int, rng: random.Random
) -> tuple[Models, SequenceBatch, str]:
    """Float64 models and a batch of about `sequences` rows made the way training makes
    them. When the untrained model's rewards do not vary (every answer wrong), a synthetic
    reward stands in so that the policy gradient is not zero: the check is about how the
    gradient is reduced, not about the task."""
    spec = job.spec
    parts = build_parts(job)
    task, encoder = parts.task, parts.encoder
    policy = to_float64(parts.policy)
    algorithm = spec.algorithm
    entry = registered(algorithm.name)
    sampling = spec.rollout.sampling
    reference = None
    if entry.needs_reference(algorithm):
        reference = _perturbed_copy(policy, spec.trainer.seed)

    def ref_logp(batch: SequenceBatch, temperature: float = sampling.temperature) -> torch.Tensor:
        return reference_logprobs(reference, batch.to(torch.float64), temperature, 64)

    if entry.source != "rollouts":
        problems = [task.train_problem(rng) for _ in range(max(1, sequences // 2))]
        if entry.source == "examples":
            batch = supervised_batch(problems, encoder.prompt, encoder.answer, encoder.pad_id)
        else:
            batch = preference_batch(problems, encoder.prompt, encoder.answer, encoder.pad_id, rng)
            batch = batch.with_fields(ref_logp=ref_logp(batch, dpo.TEMPERATURE))
        return Models(policy), batch.to(torch.float64), f"{len(batch)} sequences"

    group = algorithm.group_size
    problems = [task.train_problem(rng) for _ in range(max(1, sequences // group))]
    engine = TransformersEngine(policy, encoder.pad_id, parts.stop_ids)
    params = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens)
    generator = torch.Generator().manual_seed(spec.trainer.seed)
    rollouts = sample_and_score(
        engine,
        problems,
        encoder.prompt,
        encoder.decode,
        parts.rewards,
        group,
        params,
        generator,
    )
    completions = rollouts.completions
    note = f"{len(completions)} sampled completions, task rewards"
    if rollouts.rewards.max() == rollouts.rewards.min():
        rollouts.rewards = torch.tensor(
            [len(c.token_ids) % 3 + 0.5 * (i % 2) for i, c in enumerate(completions)],
            dtype=torch.float64,
        )
        note = f"{len(completions)} sampled completions, synthetic rewards (task rewards were flat)"
    batch = rl_batch(
        algorithm,
        rollouts,
        encoder.pad_id,
        sampling.max_new_tokens,
        ref_logp if reference is not None else None,
    )
    # Behaviour log-probs of a float64 engine equal the trainer's exactly; nudge them so
    # that ratios differ from 1 and clipping and mismatch weights are exercised.
    noise = 0.3 * torch.randn(batch.mask.shape, generator=generator, dtype=torch.float64)
    batch = batch.to(torch.float64)
    batch = batch.with_fields(behaviour_logp=batch.behaviour_logp + noise * batch.mask)
    critic = build_critic(policy) if entry.critic else None
    if critic is not None:
        torch.nn.init.normal_(critic.score.weight, std=0.1, generator=generator)
    kept = float32_norms(policy)
    if kept:  # a family whose norms rlft does not know: their float32 is not a bug
        note += (
            f"; {len(kept)} RMS norms of this model family keep their own forward (e.g."
            f" {kept[0]}): errors near 1e-8 can be their float32 rounding"
        )
    return Models(policy, critic), batch, note


def _perturbed_copy(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A frozen reference a little away from the policy, so that KL terms and DPO margins
    are not all zero."""
    import copy

    reference = copy.deepcopy(model).eval()
    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(
                0.02 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            )
            parameter.requires_grad_(False)
    return reference
