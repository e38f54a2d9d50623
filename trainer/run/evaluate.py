"""Held-out evaluation: greedy decoding, exact match."""

from __future__ import annotations

from collections.abc import Callable

from rlft.trainer.data import Problem
from rlft.trainer.data.rewards import exact_match
from rlft.trainer.rollout import SamplingParams, TransformersEngine
from rlft.trainer.telemetry import liveness

GREEDY_BATCH = 256


def greedy_accuracy(
    engine: TransformersEngine,
    problems: list[Problem],
    encode_prompt: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
) -> float:
    """Fraction of problems whose greedy completion exactly matches the answer."""
    if not problems:
        return float("nan")
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    correct = 0.0
    for start in range(0, len(problems), GREEDY_BATCH):
        liveness.beat(f"evaluating: problem {start + 1} of {len(problems)}")
        chunk = problems[start : start + GREEDY_BATCH]
        completions = engine.generate([encode_prompt(p.prompt) for p in chunk], 1, greedy)
        for problem, completion in zip(chunk, completions, strict=True):
            correct += exact_match(decode(completion.token_ids), problem.answer)
    return correct / len(problems)
