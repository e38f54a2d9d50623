"""What every prompt source provides: training problems in a seeded order, held-out
problems, and the text a tokenizer can be trained on."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from rlft.trainer.config import DataSpec


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer."""

    prompt: str
    answer: str
    rejected: str | None = None
    """A dispreferred answer, for preference pairs (DPO); None when the source has none."""
    origin: str = field(default="", compare=False)
    """Where it was read (`file:line`), for errors that name it; empty when generated."""


class Task(Protocol):
    def train_problem(self, rng: random.Random) -> Problem:
        """Draw one training problem (never one of the held-out problems)."""
        ...

    def eval_problems(self) -> list[Problem]:
        """The held-out problems, in a fixed order."""
        ...

    def corpus(self) -> Iterator[str]:
        """Text representative of prompts and answers, for training a tokenizer."""
        ...


def build_task(spec: DataSpec, seed: int) -> Task:
    """The job's prompt source."""
    if spec.source == "arithmetic":
        from rlft.trainer.data.arithmetic import ArithmeticProblems

        return ArithmeticProblems(spec.arithmetic, seed)
    from rlft.trainer.data.jsonl import JsonlProblems

    assert spec.jsonl is not None
    return JsonlProblems(spec.jsonl)
