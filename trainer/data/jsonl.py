"""Prompts with reference answers from JSON Lines files."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from rlft.trainer.config import JsonlTask
from rlft.trainer.data.task import Problem


class DataFileError(Exception):
    """A prompt file that cannot be used; the message names the file, line and key."""


def read_problems(
    path: str, prompt_field: str, answer_field: str, rejected_field: str | None = None
) -> list[Problem]:
    file = Path(path)
    try:
        lines = file.read_text().splitlines()
    except OSError as error:
        raise DataFileError(f"{path}: cannot read ({error.strerror})") from None
    problems = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataFileError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise DataFileError(f"{path}:{number}: each line must be a JSON object")
        keys = (prompt_field, answer_field) + ((rejected_field,) if rejected_field else ())
        for key in keys:
            if not isinstance(row.get(key), str | int | float):
                raise DataFileError(
                    f"{path}:{number}: key {key!r} is missing or not text (set "
                    "spec.data.jsonl.promptField/answerField/rejectedField to the file's keys)"
                )
        rejected = str(row[rejected_field]) if rejected_field else None
        problems.append(
            Problem(prompt=str(row[prompt_field]), answer=str(row[answer_field]), rejected=rejected)
        )
    if not problems:
        raise DataFileError(f"{path}: holds no problems")
    return problems


class JsonlProblems:
    def __init__(self, spec: JsonlTask):
        self.spec = spec
        fields = (spec.prompt_field, spec.answer_field, spec.rejected_field)
        self._train = read_problems(spec.train, *fields)
        self._eval = read_problems(spec.eval, *fields) if spec.eval else []

    def train_problem(self, rng: random.Random) -> Problem:
        return rng.choice(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def corpus(self) -> Iterator[str]:
        for problem in self._train + self._eval:
            yield problem.prompt + problem.answer
