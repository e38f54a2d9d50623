"""Training batches, made on rank 0.

Rollout algorithms: sample groups from a rollout engine, score them, shape the rewards
(DAPO's overlong penalty), drop uninformative groups and refill (dynamic sampling), then
let the algorithm's registry entry turn them into its batch (advantages, or per-token
rewards for GAE). DPO: (chosen, rejected) pairs. SFT: prompt + reference answer.
Reference log-probs are filled in here too, so trainer ranks only need the policy.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from rlft.trainer.algorithms.advantages import informative_groups, overlong_penalty
from rlft.trainer.algorithms.batch import SequenceBatch, micro_batches, pack
from rlft.trainer.algorithms.losses import kl_estimate, token_logprobs
from rlft.trainer.algorithms.registry import algorithm
from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.data import Problem
from rlft.trainer.rollout import Completion


@dataclass
class Rollouts:
    """Completions of `group_size` samples per prompt, groups contiguous."""

    prompt_ids: list[list[int]]
    problems: list[Problem]
    completions: list[Completion]
    rewards: torch.Tensor
    """Task reward per completion (before shaping)."""
    accuracy: float = float("nan")
    stats: dict[str, float] = field(default_factory=dict)
    phases: list[tuple[str, int, int]] = field(default_factory=list)
    """(phase, start, end) in `time.time_ns()` of the generation and scoring that made
    these rollouts: the step's trace spans and phase metrics come from them."""


def reference_logprobs(
    reference: torch.nn.Module, batch: SequenceBatch, temperature: float, micro_batch_size: int
) -> torch.Tensor:
    """Per-position log-probs of the batch's targets under the frozen reference."""
    out = torch.zeros_like(batch.mask, dtype=torch.float64)
    row = 0
    with torch.no_grad():
        for micro in micro_batches(batch, micro_batch_size):
            logits = reference(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
            logp = token_logprobs(logits.logits, micro.targets, temperature)
            out[row : row + len(micro), : logp.shape[1]] = logp
            row += len(micro)
    return out.to(batch.mask.dtype)


def shaped_rewards(spec: AlgorithmSpec, rollouts: Rollouts, max_new_tokens: int) -> torch.Tensor:
    """Task rewards plus DAPO's soft overlong penalty."""
    lengths = torch.tensor([len(c.token_ids) for c in rollouts.completions])
    penalty = overlong_penalty(
        lengths, max_new_tokens, spec.overlong.soft_penalty_tokens, spec.overlong.penalty
    )
    return rollouts.rewards.to(torch.float64) + penalty


def rl_batch(
    spec: AlgorithmSpec,
    rollouts: Rollouts,
    pad_id: int,
    max_new_tokens: int,
    reference: Callable[[SequenceBatch], torch.Tensor] | None,
) -> SequenceBatch:
    """The training batch of a rollout algorithm from scored rollouts: packed, overlong
    filtered, rewards shaped, reference log-probs and KL filled in, then shaped by the
    algorithm's registry entry (advantages, or per-token rewards for GAE)."""
    completions = rollouts.completions
    batch = pack(
        [rollouts.prompt_ids[c.prompt_index] for c in completions],
        [c.token_ids for c in completions],
        pad_id,
        [c.logprobs for c in completions],
    )
    if spec.overlong.filter:
        keep = torch.tensor([c.finish_reason != "length" for c in completions])
        batch = batch.with_fields(mask=batch.mask * keep.reshape(-1, 1).to(batch.mask.dtype))
    rewards = shaped_rewards(spec, rollouts, max_new_tokens)
    token_kl = torch.zeros_like(batch.mask, dtype=torch.float64)
    if reference is not None:
        batch = batch.with_fields(ref_logp=reference(batch))
        # The rollout policy's KL, on its own samples: the importance ratio is 1 here.
        on_policy = torch.ones_like(batch.behaviour_logp)
        token_kl = kl_estimate(batch.behaviour_logp, batch.ref_logp, spec.kl.estimator, on_policy)
        token_kl = (token_kl * batch.mask).to(torch.float64)
    return algorithm(spec.name).shape(spec, batch, rewards, token_kl)


def select_groups(rollouts: Rollouts, keep: list[int], group_size: int) -> Rollouts:
    """Only the groups (prompts) listed in `keep`, in that order, re-indexed."""
    index = {old: new for new, old in enumerate(keep)}
    completions = [
        replace(c, prompt_index=index[c.prompt_index])
        for c in rollouts.completions
        if c.prompt_index in index
    ]
    rewards = rollouts.rewards.reshape(-1, group_size)[torch.tensor(keep, dtype=torch.long)]
    return Rollouts(
        [rollouts.prompt_ids[i] for i in keep],
        [rollouts.problems[i] for i in keep],
        completions,
        rewards.reshape(-1),
        rollouts.accuracy,
        dict(rollouts.stats),
        list(rollouts.phases),
    )


def keep_informative(rollouts: Rollouts, group_size: int) -> Rollouts:
    """Only the groups whose rewards differ (DAPO's dynamic sampling)."""
    keep = informative_groups(rollouts.rewards, group_size).tolist()
    return select_groups(rollouts, [i for i, k in enumerate(keep) if k], group_size)


def concat(parts: list[Rollouts], limit: int, group_size: int) -> Rollouts:
    """The first `limit` groups of several rollout batches."""
    prompt_ids, problems, completions, rewards, phases = [], [], [], [], []
    for part in parts:
        phases += part.phases
        offset = len(prompt_ids)
        prompt_ids += part.prompt_ids
        problems += part.problems
        completions += [replace(c, prompt_index=c.prompt_index + offset) for c in part.completions]
        rewards.append(part.rewards)
    out = Rollouts(prompt_ids, problems, completions, torch.cat(rewards), phases=phases)
    out.prompt_ids, out.problems = out.prompt_ids[:limit], out.problems[:limit]
    out.completions = [c for c in out.completions if c.prompt_index < limit]
    out.rewards = out.rewards[: limit * group_size]
    return out


def wrong_answers(answer: str) -> list[str]:
    """Every answer `wrong_answer` may pick for `answer`: the integers within 10 of it, or
    its mangled string. A context check takes the longest of them."""
    try:
        value = int(answer)
    except ValueError:
        return [answer[::-1] if answer[::-1] != answer else answer + "?"]
    return [str(value + delta) for delta in range(-10, 11) if delta]


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer for a preference pair: a nearby integer, or a mangled
    string for non-numeric answers."""
    candidates = wrong_answers(answer)
    return candidates[0] if len(candidates) == 1 else rng.choice(candidates)


def preference_batch(
    problems: list[Problem],
    encode_prompt: Callable[[str], list[int]],
    encode_answer: Callable[[str], list[int]],
    pad_id: int,
    rng: random.Random,
) -> SequenceBatch:
    """Rows (chosen, rejected) per problem: the reference answer against the source's
    rejected answer, or a nearby wrong one."""
    prompts, answers = [], []
    for problem in problems:
        rejected = problem.rejected or wrong_answer(problem.answer, rng)
        prompt = encode_prompt(problem.prompt)
        prompts += [prompt, prompt]
        answers += [encode_answer(problem.answer), encode_answer(rejected)]
    return pack(prompts, answers, pad_id)


def supervised_batch(
    problems: list[Problem],
    encode_prompt: Callable[[str], list[int]],
    encode_answer: Callable[[str], list[int]],
    pad_id: int,
) -> SequenceBatch:
    return pack(
        [encode_prompt(p.prompt) for p in problems],
        [encode_answer(p.answer) for p in problems],
        pad_id,
    )


def sample_and_score(
    engine,
    problems: list[Problem],
    encode_prompt: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    reward_model,
    group_size: int,
    sampling,
    generator: torch.Generator,
) -> Rollouts:
    """One round: `group_size` completions per problem, scored by the job's rewards."""
    prompt_ids = [encode_prompt(p.prompt) for p in problems]
    started = time.time_ns()
    completions = engine.generate(prompt_ids, group_size, sampling, generator)
    generated = time.time_ns()
    texts = [decode(c.token_ids) for c in completions]
    answers = [problems[c.prompt_index].answer for c in completions]
    scores = reward_model.score(texts, answers)
    exact = scores.per_term.get("exact_match")
    accuracy = sum(exact) / len(exact) if exact else float("nan")
    phases = [("generate", started, generated), ("score", generated, time.time_ns())]
    rewards = torch.tensor(scores.total)
    return Rollouts(prompt_ids, problems, completions, rewards, accuracy, phases=phases)


def collect(
    draw: Callable[[int], list[Problem]],
    sample: Callable[[list[Problem]], Rollouts],
    prompts: int,
    group_size: int,
    dynamic: bool,
    max_rounds: int,
) -> Rollouts:
    """Rollouts for `prompts` prompts; with dynamic sampling, only informative groups,
    sampling more rounds (at most `max_rounds`) until enough are found."""
    first = sample(draw(prompts))
    if not dynamic:
        first.stats["samples"] = float(len(first.completions))
        return first
    kept, rounds, seen = [], 0, 0
    accuracy_sum, count = 0.0, 0
    part = first
    while True:
        rounds += 1
        seen += len(part.problems)
        accuracy_sum += part.accuracy * len(part.completions)
        count += len(part.completions)
        kept.append(keep_informative(part, group_size))
        have = sum(len(k.problems) for k in kept)
        if have >= prompts or rounds >= max_rounds:
            break
        part = sample(draw(prompts))
    out = concat(kept, prompts, group_size)
    out.accuracy = accuracy_sum / max(count, 1)
    out.stats = {
        "sampling_rounds": rounds,
        "groups_kept": min(have, prompts),
        "groups_seen": seen,
        "samples": float(count),  # received, kept or not (the staleness alert's denominator)
    }
    return out
