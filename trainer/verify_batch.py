"""The small batch `rlft verify` checks: real rollouts of the job's own model and task."""

from __future__ import annotations

import random

import torch

from rlft.trainer.algorithms.objectives import Models
from rlft.trainer.batch import SequenceBatch
from rlft.trainer.config import RLFineTune
from rlft.trainer.data import build_task
from rlft.trainer.encoding import Encoder
from rlft.trainer.modeling import build_critic, build_policy, to_float64
from rlft.trainer.orchestrator import (
    Rollouts,
    preference_batch,
    reference_logprobs,
    rl_batch,
    supervised_batch,
)
from rlft.trainer.rewards import RewardModel
from rlft.trainer.rollout import SamplingParams, TransformersEngine
from rlft.trainer.tokenizer import stop_token_ids


def verification_batch(
    job: RLFineTune, sequences: int, rng: random.Random
) -> tuple[Models, SequenceBatch, str]:
    """Float64 models and a batch of about `sequences` rows made the way training makes
    them. When the untrained model's rewards do not vary (every answer wrong), a synthetic
    reward stands in so that the policy gradient is not zero: the check is about how the
    gradient is reduced, not about the task."""
    spec = job.spec
    task = build_task(spec.data, spec.trainer.seed)
    policy, tokenizer = build_policy(spec.model, task.corpus(), spec.trainer.seed)
    policy = to_float64(policy)
    stops = stop_token_ids(tokenizer)
    encoder = Encoder(tokenizer, spec.data, int(stops[0]))
    algorithm = spec.algorithm
    sampling = spec.rollout.sampling
    reference = None
    if algorithm.kl.coef > 0 or algorithm.name == "dpo":
        reference = _perturbed_copy(policy, spec.trainer.seed)

    def ref_logp(batch: SequenceBatch) -> torch.Tensor:
        return reference_logprobs(reference, batch.to(torch.float64), sampling.temperature, 64)

    if algorithm.name in ("dpo", "sft"):
        problems = [task.train_problem(rng) for _ in range(max(1, sequences // 2))]
        if algorithm.name == "sft":
            batch = supervised_batch(problems, encoder.prompt, encoder.answer, encoder.pad_id)
        else:
            batch = preference_batch(problems, encoder.prompt, encoder.answer, encoder.pad_id, rng)
            batch = batch.with_fields(ref_logp=ref_logp(batch))
        return Models(policy), batch.to(torch.float64), f"{len(batch)} sequences"

    group = algorithm.group_size
    problems = [task.train_problem(rng) for _ in range(max(1, sequences // group))]
    prompt_ids = [encoder.prompt(p.prompt) for p in problems]
    engine = TransformersEngine(policy, encoder.pad_id, stops)
    params = SamplingParams(sampling.temperature, sampling.top_p, sampling.max_new_tokens)
    generator = torch.Generator().manual_seed(spec.trainer.seed)
    completions = engine.generate(prompt_ids, group, params, generator)
    texts = [encoder.decode(c.token_ids) for c in completions]
    answers = [problems[c.prompt_index].answer for c in completions]
    rewards = torch.tensor(RewardModel(spec.reward).score(texts, answers).total)
    note = f"{len(completions)} sampled completions, task rewards"
    if rewards.max() == rewards.min():
        rewards = torch.tensor(
            [len(c.token_ids) % 3 + 0.5 * (i % 2) for i, c in enumerate(completions)],
            dtype=torch.float64,
        )
        note = f"{len(completions)} sampled completions, synthetic rewards (task rewards were flat)"
    rollouts = Rollouts(prompt_ids, problems, completions, rewards)
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
    critic = build_critic(policy) if algorithm.name == "ppo" else None
    if critic is not None:
        torch.nn.init.normal_(critic.score.weight, std=0.1, generator=generator)
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
