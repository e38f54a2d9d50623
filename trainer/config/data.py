"""The data and reward sections: where prompts and reference answers come from, and how
completions are scored."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlft.trainer.config.base import Section

_USER_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ArithmeticTask(Section):
    """Built-in verifiable task: integer arithmetic with exact answers."""

    digits: int = Field(3, ge=1, le=12)
    """Number of digits of each operand."""
    exact_digits: bool = True
    """Operands have exactly `digits` digits (e.g. 100–999); false allows fewer (0–999)."""
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1)
    """Operators to draw from."""
    eval_size: int = Field(500, ge=1, le=1_000_000)
    """Held-out problems for evaluation (never seen in training): at most half of the
    distinct problems `digits`, `exactDigits` and `operations` allow."""
    held_out_seed: int | None = Field(None, ge=0, le=2**31 - 1)
    """Seed of the held-out draw. Unset: the run's seed (`trainer.seed`). Set it to
    compare runs of several seeds on the same held-out problems (their accuracies
    otherwise differ by the split as well as by the run)."""

    def operand_range(self) -> tuple[int, int]:
        """The smallest and the largest operand."""
        low = 10 ** (self.digits - 1) if self.exact_digits and self.digits > 1 else 0
        return low, 10**self.digits - 1

    def room_problem(self) -> str | None:
        """What is wrong with `evalSize` against the distinct problems the settings allow
        (None: it leaves enough to train on)."""
        low, high = self.operand_range()
        space = (high - low + 1) ** 2 * len(self.operations)
        if self.eval_size > space // 2:
            return (
                f"arithmetic.evalSize: {self.eval_size} held-out problems leave too few for "
                f"training among {space} possible; lower evalSize or raise digits"
            )
        return None


class JsonlTask(Section):
    """Prompts with reference answers from JSON Lines files."""

    train: str = Field(min_length=1)
    """Path of the training file: one JSON object per line. Every problem (and every
    held-out one) must fit the model's context, the prompt with maxNewTokens or, for sft
    and dpo, with its answers: checked once when the job starts, naming the line."""
    eval: str | None = None
    """Path of the held-out file (optional; without it, or empty, no accuracy is
    reported)."""
    prompt_field: str = "prompt"
    """Key of the prompt text in each object."""
    answer_field: str = "answer"
    """Key of the reference answer in each object (the preferred answer for DPO)."""
    rejected_field: str | None = None
    """Key of a dispreferred answer, for DPO pairs (without it DPO pairs each answer with
    a nearby wrong one)."""
    chat: bool = False
    """Wrap each prompt in the tokenizer's chat template."""


class DataSpec(Section):
    """Where prompts and reference answers come from."""

    source: Literal["arithmetic", "jsonl"] = "arithmetic"
    """`arithmetic` (built in, nothing downloaded) or `jsonl` files."""
    arithmetic: ArithmeticTask = ArithmeticTask()
    """Settings of the built-in arithmetic task."""
    jsonl: JsonlTask | None = None
    """Settings of the JSON Lines source (required when source is `jsonl`)."""

    @model_validator(mode="after")
    def _jsonl_needs_files(self) -> DataSpec:
        # Checked here too, not only when the task is built: on Kubernetes that is in the
        # trainer, after the pods were made. Not for a job that does not use the task.
        problem = self.arithmetic.room_problem() if self.source == "arithmetic" else None
        if problem:
            raise ValueError(problem)
        if self.source == "jsonl" and self.jsonl is None:
            raise ValueError("source `jsonl` needs the `jsonl` section with a `train` file")
        if self.source != "jsonl" and self.jsonl is not None:
            raise ValueError(
                f"a `jsonl` section with source `{self.source}` would be ignored: set "
                "`source: jsonl`, or remove the section"
            )
        return self


class RewardFunction(Section):
    """One reward term; the reward of a completion is the weighted sum of all terms."""

    name: str
    """`exact_match`, `format`, or user code as `package.module:function` taking
    (completion: str, answer: str) and returning a float."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this term in the sum."""

    @field_validator("name")
    @classmethod
    def _known_or_user_function(cls, name: str) -> str:
        if name in ("exact_match", "format") or _USER_FUNCTION.match(name):
            return name
        raise ValueError(
            f"unknown reward {name!r}: use `exact_match`, `format` or `package.module:function`"
        )


class RewardSpec(Section):
    """How completions are scored."""

    functions: list[RewardFunction] = Field(
        default_factory=lambda: [RewardFunction(name="exact_match")], min_length=1
    )
    """Reward terms, summed with their weights."""
