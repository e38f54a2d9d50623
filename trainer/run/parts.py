"""The parts of a job that can reject it, built before anything is written: the task,
the rewards, the policy and its tokenizer, and the prompt/answer encoding. The job
runner and `rlft verify` build them the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlft.trainer.config import RLFineTune
from rlft.trainer.config.algorithm import SOURCES
from rlft.trainer.data import Task, build_task
from rlft.trainer.data.arithmetic import ArithmeticProblems
from rlft.trainer.data.jsonl import DataFileError, JsonlProblems
from rlft.trainer.data.rewards import RewardModel
from rlft.trainer.model.build import build_policy
from rlft.trainer.model.encoding import Encoder
from rlft.trainer.model.tokenizer import stop_token_ids
from rlft.trainer.rollout.batches import wrong_answers


@dataclass
class JobParts:
    task: Task
    rewards: RewardModel
    policy: torch.nn.Module
    tokenizer: Any
    encoder: Encoder
    stop_ids: list[int]


def build_parts(job: RLFineTune) -> JobParts:
    """Raises the data, reward or model error that names what to fix."""
    spec = job.spec
    task = build_task(spec.data, spec.trainer.seed)
    rewards = RewardModel(spec.reward)
    policy, tokenizer = build_policy(spec.model, task.corpus(), spec.trainer.seed)
    stops = stop_token_ids(tokenizer)
    encoder = Encoder(tokenizer, spec.data, int(stops[0]))
    positions = context_positions(getattr(policy, "config", None))
    if positions:
        check_context(job, task, encoder, positions)
    return JobParts(task, rewards, policy, tokenizer, encoder, stops)


def context_positions(config: Any) -> int | None:
    """The positions a model serves, prompt and completion together (None: unknown): its
    `max_position_embeddings`, times a rope scaling's factor (YaRN and the like extend
    the trained context by it, and vLLM serves that many)."""
    positions = getattr(config, "max_position_embeddings", None)
    if not positions:
        return None
    for name in ("rope_parameters", "rope_scaling"):
        scaling = getattr(config, name, None)
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        if isinstance(factor, int | float) and factor > 1:
            return int(positions * factor)
    return int(positions)


def longest_wrong(answer: str) -> list[str]:
    """The made-up wrong answers of `answer` with the most characters (tokenising all
    twenty of each line of a million-line file took long at every start)."""
    candidates = wrong_answers(answer)
    most = max(len(c) for c in candidates)
    widest = [c for c in candidates if len(c) == most]
    return [widest[0], widest[-1]]


def check_context(job: RLFineTune, task: Task, encoder: Encoder, positions: int) -> None:
    """Every problem fits the model's context, or the job is refused before it starts
    (exit 2, naming the line). Found at a step instead, a problem too long fails that step
    on a rollout server (400) and its restart draws the same problem again: a crash loop
    days into a run; the in-process engine sampled from positions never trained.

    A generated completion may take `rollout.sampling.maxNewTokens` after its prompt (the
    held-out problems evaluated are generated for every algorithm); a supervised example
    or a preference pair (sft, dpo, a rollout job's warm start) takes its answers' own
    tokens. The built-in arithmetic task's training problems are checked by its longest
    ones (they were not at all: a warm start trained past the context)."""
    spec = job.spec
    new_tokens = spec.rollout.sampling.max_new_tokens
    generated = SOURCES[spec.algorithm.name] == "rollouts"
    # A pair without its own rejected answer gets one made up, possibly a character longer
    # (99 → 109, 5 → -5): the check takes the longest it may be.
    preferences = SOURCES[spec.algorithm.name] == "pairs"
    training: list = []
    shorten = "shorten the prompt or its answers, or drop the line"
    if isinstance(task, JsonlProblems):
        training = task.training_problems()
    elif isinstance(task, ArithmeticProblems):
        training = task.longest()
        shorten = "lower spec.data.arithmetic.digits, or give the model more positions"
    evaluated = task.eval_problems()[: spec.eval.max_problems]
    checked = [(p, True) for p in evaluated] + [(p, False) for p in training]
    lengths = encoder.prompt_lengths([problem.prompt for problem, _ in checked])
    # A rollout job's warm start trains on the answers too (algorithm.sft.steps).
    supervised = not generated or spec.algorithm.sft.steps > 0
    for (problem, held_out), prompt in zip(checked, lengths, strict=True):
        need = 0
        if held_out or generated:
            need, after = prompt + new_tokens, f"rollout.sampling.maxNewTokens {new_tokens}"
            fix = f"{shorten}, or lower rollout.sampling.maxNewTokens"
        if supervised and not held_out:
            answers = [problem.answer]
            if preferences:
                answers += [problem.rejected] if problem.rejected else longest_wrong(problem.answer)
            longest = max(len(encoder.answer(a)) for a in answers)
            if prompt + longest > need:
                need, after = prompt + longest, f"its longest answer's {longest} tokens"
                fix = shorten
        if need > positions:
            where = problem.origin or f"held-out problem {problem.prompt!r}"
            raise DataFileError(
                f"{where}: the prompt's {prompt} tokens and {after} exceed the model's "
                f"{positions} positions: {fix}"
            )
