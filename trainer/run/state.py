"""Where a run stands: the one owner of the step, the policy version and the random
streams of the data and of sampling. Everything a resume needs besides tensors; saved
in every checkpoint as JSON (through the one codec in `checkpoint.rng`).

The policy version counts applied updates and never goes back: a rollback publishes
the restored weights as a new version. The in-process engine and the rollout servers
are told the version; they do not own it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from rlft.trainer.checkpoint.rng import (
    generator_state,
    random_state,
    set_generator_state,
    set_random_state,
)


@dataclass
class Cursor:
    seed: int
    step: int = 0
    policy_version: int = 0
    sft_steps: int = 0
    results: dict[str, float] = field(default_factory=dict)
    """Figures computed once before the main phase (e.g. accuracy after the warm start)."""
    rng: random.Random = field(init=False)
    """The data stream: which prompts, pairs and examples come next."""
    generator: torch.Generator = field(init=False)
    """The sampling stream of the in-process engine (seeds of the rollout servers')."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    def set_streams(self, streams: dict[str, Any]) -> None:
        """Point both streams at a saved state (`streams_json()`'s form)."""
        set_random_state(self.rng, streams["rng"])
        set_generator_state(self.generator, streams["generator"])

    def streams_json(self) -> dict[str, Any]:
        return {"rng": random_state(self.rng), "generator": generator_state(self.generator)}

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "step": self.step,
            "policy_version": self.policy_version,
            "sft_steps": self.sft_steps,
            "results": self.results,
            **self.streams_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cursor:
        cursor = cls(data["seed"], data["step"], data["policy_version"], data["sft_steps"])
        cursor.results = dict(data["results"])
        cursor.set_streams(data)
        return cursor
