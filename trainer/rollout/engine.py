"""What every rollout engine returns: the rollout protocol's data, engine-independent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    greedy: bool = False


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    """Index of the prompt in the request."""
    token_ids: list[int]
    """Completion tokens, including the stop token when it finished with one."""
    logprobs: list[float]
    """Behaviour log-prob of each token under the sampling distribution (softmax of
    logits / temperature), as the engine saw it."""
    finish_reason: Literal["stop", "length"]
    """`stop` when a stop token ended it, `length` when it hit maxNewTokens."""
    policy_version: int
    """Version of the weights that produced every token of it."""
