"""What every rollout engine returns: the rollout protocol's data, engine-independent."""

from __future__ import annotations

from collections.abc import Iterable
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


TIED_ALIAS = "lm_head.weight"
"""The output layer's name, an alias of the embeddings in a model that ties them."""


class WeightNamesError(ValueError):
    """A weight set that is not the served model's, refused before any tensor of it was
    copied: the served weights are intact."""


def check_names(expected: Iterable[str], given: Iterable[str], tied: bool) -> None:
    """Refuse a weight set that names a tensor the served model lacks, or lacks one of
    its own (but the tied output layer, an alias a publisher leaves out): loaded as it
    is, part of the model would keep its old weights under the new version's number."""
    expected, given = set(expected), set(given)
    unexpected = sorted(given - expected)
    if unexpected:
        raise WeightNamesError(
            f"weights name {len(unexpected)} tensor(s) the served model lacks, "
            f"e.g. {unexpected[0]!r}: publish weights of the same architecture"
        )
    missing = sorted(n for n in expected - given if not (tied and n == TIED_ALIAS))
    if missing:
        raise WeightNamesError(
            f"weights lack {len(missing)} tensor(s) of the served model, e.g. {missing[0]!r}: "
            "publish every tensor of the model"
        )
