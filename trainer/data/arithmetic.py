"""Built-in verifiable task: integer arithmetic with exact answers, no download.

The held-out split is drawn first from its own seed and excluded from training, so
evaluation measures generalisation, not memorisation.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

from rlft.trainer.config import ArithmeticTask
from rlft.trainer.data.task import Problem

_EVAL_SEED_OFFSET = 1_000_003


def solve(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def render(a: int, op: str, b: int) -> Problem:
    return Problem(prompt=f"{a}{op}{b}=", answer=str(solve(a, op, b)))


class ArithmeticProblems:
    """`a op b =` with operands of `digits` digits (or up to that many)."""

    def __init__(self, spec: ArithmeticTask, seed: int):
        self.spec = spec
        self.low, self.high = spec.operand_range()
        if problem := spec.room_problem():
            raise ValueError(f"spec.data.{problem}")
        split = seed if spec.held_out_seed is None else spec.held_out_seed
        rng = random.Random(split + _EVAL_SEED_OFFSET)
        held_out: dict[tuple[int, str, int], Problem] = {}
        while len(held_out) < spec.eval_size:
            key = self._draw(rng)
            held_out.setdefault(key, render(*key))
        self._held_out = held_out

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        op = rng.choice(self.spec.operations)
        return rng.randint(self.low, self.high), op, rng.randint(self.low, self.high)

    def train_problem(self, rng: random.Random) -> Problem:
        while True:
            key = self._draw(rng)
            if key not in self._held_out:
                return render(*key)

    def eval_problems(self) -> list[Problem]:
        return list(self._held_out.values())

    def longest(self) -> list[Problem]:
        """The problems with the longest prompt and answer of each operation (the widest
        operands; for `-` the widest negative result too, whatever exactDigits says): what a
        context check of the training problems, never all listed, must take."""
        widest = 10 ** (self.spec.digits - 1) if self.spec.digits > 1 else 0
        found = []
        for op in self.spec.operations:
            keys = [(self.high, op, self.high)] + ([(widest, op, self.high)] if op == "-" else [])
            for key in keys:
                problem = render(*key)
                found.append(replace(problem, origin=f"spec.data.arithmetic: {problem.prompt}"))
        return found

    def corpus(self) -> Iterator[str]:
        rng = random.Random(0)
        for _ in range(2000):
            problem = self.train_problem(rng)
            yield problem.prompt + problem.answer
