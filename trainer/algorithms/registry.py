"""One entry per algorithm, registered once by the algorithm's own module: its objective,
how its training batch is shaped, what it needs besides the policy (a frozen reference,
a critic) and which batch source feeds it. The job runner, the step loop, the rollout
batch builder and `rlft verify` read the entry; nothing else branches on a name.

    entry = algorithm(spec.name)
    objective = entry.objective(spec, temperature, max_new_tokens)
    entry.source             # "rollouts" | "pairs" | "examples" (from config.algorithm)
    entry.needs_reference(spec), entry.critic
    entry.shape(spec, batch, rewards, token_kl)   # rollouts only: advantages or rewards
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.config.algorithm import SOURCES, AlgorithmSpec, BatchSource

Shape = Callable[[AlgorithmSpec, SequenceBatch, torch.Tensor, torch.Tensor], SequenceBatch]
"""(spec, packed rollouts, shaped reward per sequence, masked per-token KL) → the batch
with what the objective reads (`advantages`, or `token_rewards` for GAE)."""


@dataclass(frozen=True)
class Algorithm:
    name: str
    objective: Callable[[AlgorithmSpec, float, int], Any]
    """(spec, sampling temperature, maxNewTokens) → the objective the learner runs."""
    shape: Shape | None = None
    """How scored rollouts become a training batch (rollout algorithms only)."""
    reference: bool = False
    """Needs the frozen reference whatever the KL coefficient (DPO)."""
    critic: bool = False
    """Trains a critic beside the policy (PPO)."""

    @property
    def source(self) -> BatchSource:
        """What feeds a step: scored rollouts, preference pairs, or supervised examples
        (declared torch-free in `config.algorithm.SOURCES`, for the operator too)."""
        return SOURCES[self.name]

    def needs_reference(self, spec: AlgorithmSpec) -> bool:
        return self.reference or spec.kl.coef > 0


_REGISTRY: dict[str, Algorithm] = {}


def register(entry: Algorithm) -> Algorithm:
    if entry.name in _REGISTRY:
        raise ValueError(f"algorithm {entry.name!r} is registered twice")
    if entry.name not in SOURCES:
        raise ValueError(f"algorithm {entry.name!r} has no source in config.algorithm.SOURCES")
    if (entry.source == "rollouts") != (entry.shape is not None):
        raise ValueError(f"{entry.name}: rollout algorithms, and only they, shape batches")
    _REGISTRY[entry.name] = entry
    return entry


def algorithm(name: str) -> Algorithm:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown algorithm {name!r}: use one of {known}") from None


def names() -> list[str]:
    return sorted(_REGISTRY)


def build_objective(spec: AlgorithmSpec, temperature: float, max_new_tokens: int):
    """The objective of `spec.name` (the rollout's maxNewTokens is the default constant
    normaliser of Dr. GRPO's `constant` aggregation)."""
    return algorithm(spec.name).objective(spec, temperature, max_new_tokens)


# Each module registers its entries on import; importing them here makes the registry
# complete whichever module a caller imported first.
from rlft.trainer.algorithms import dpo, grpo, ppo, sft  # noqa: E402, F401
