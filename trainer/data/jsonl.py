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


def read_problems(path: str, prompt_field: str, answer_field: str) -> list[Problem]:
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
        for key in (prompt_field, answer_field):
            if not isinstance(row.get(key), str | int | float):
                raise DataFileError(
                    f"{path}:{number}: key {key!r} is missing or not text "
                    f"(set spec.data.jsonl.promptField/answerField to the file's keys)"
                )
        problems.append(Problem(prompt=str(row[prompt_field]), answer=str(row[answer_field])))
    if not problems:
        raise DataFileError(f"{path}: holds no problems")
    return problems


class JsonlProblems:
    def __init__(self, spec: JsonlTask):
        self.spec = spec
        self._train = read_problems(spec.train, spec.prompt_field, spec.answer_field)
        self._eval = (
            read_problems(spec.eval, spec.prompt_field, spec.answer_field) if spec.eval else []
        )

    def train_problem(self, rng: random.Random) -> Problem:
        return rng.choice(self._train)

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def corpus(self) -> Iterator[str]:
        for problem in self._train + self._eval:
            yield problem.prompt + problem.answer
