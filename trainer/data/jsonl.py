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


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _without_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    row: dict[str, object] = {}
    for key, value in pairs:
        if key in row:
            raise _DuplicateKey(key)
        row[key] = value
    return row


def read_problems(
    path: str, prompt_field: str, answer_field: str, rejected_field: str | None = None
) -> list[Problem]:
    file = Path(path)
    try:
        # Bytes, split on newlines only: str.splitlines also splits on U+2028, U+2029 and
        # U+0085, which JSON strings may hold unescaped; and no locale decides the text.
        lines = file.read_bytes().split(b"\n")
    except OSError as error:
        raise DataFileError(f"{path}: cannot read ({error.strerror})") from None
    problems = []
    for number, raw in enumerate(lines, start=1):
        try:
            # utf-8-sig on the first line: an editor's byte-order mark is not an error
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise DataFileError(
                f"{path}:{number}: not UTF-8 (byte {raw[error.start]:#04x} at column "
                f"{error.start + 1}); save the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            # Numbers kept as written: str() of a parsed 1e3 is "1000.0", of 3.50 "3.5",
            # and an answer rewritten so never matches a completion that says it.
            row = json.loads(
                line, parse_float=str, parse_int=str, object_pairs_hook=_without_duplicates
            )
        except json.JSONDecodeError as error:
            raise DataFileError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        except RecursionError:  # arrays or objects nested thousands deep
            raise DataFileError(f"{path}:{number}: JSON nested too deeply to read") from None
        except _DuplicateKey as duplicate:  # the last would have been taken, silently
            raise DataFileError(
                f"{path}:{number}: key {duplicate.key!r} is given twice; keep one"
            ) from None
        if not isinstance(row, dict):
            raise DataFileError(f"{path}:{number}: each line must be a JSON object")
        keys = (prompt_field, answer_field) + ((rejected_field,) if rejected_field else ())
        for key in keys:
            if not isinstance(row.get(key), str):  # numbers arrive as their text
                raise DataFileError(
                    f"{path}:{number}: key {key!r} is missing or not text or a number (set "
                    "spec.data.jsonl.promptField/answerField/rejectedField to the file's keys)"
                )
            try:
                row[key].encode("utf-8")
            except UnicodeEncodeError as error:
                # json.loads takes an escape of half a UTF-16 pair ("\\ud800") for text; the
                # tokenizer refused it mid-run, after the warm start, with a bare TypeError.
                raise DataFileError(
                    f"{path}:{number}: key {key!r} holds \\u{ord(row[key][error.start]):04x}, "
                    "half of a UTF-16 surrogate pair, which is no text; write the character "
                    "itself or its whole pair"
                ) from None
        if not row[prompt_field]:
            # No tokens to answer: the engine refused it at the first step, naming no line.
            raise DataFileError(
                f"{path}:{number}: key {prompt_field!r} is empty; give each line a prompt"
            )
        rejected = str(row[rejected_field]) if rejected_field else None
        if rejected is not None and not rejected:
            raise DataFileError(
                f"{path}:{number}: key {rejected_field!r} is empty: DPO would have paired the "
                "answer with a made-up wrong one; give each line its rejected answer"
            )
        if rejected is not None and rejected == row[answer_field]:
            raise DataFileError(
                f"{path}:{number}: key {rejected_field!r} is the answer itself: a pair with no "
                "preference in it; give a different rejected answer or drop the line"
            )
        problems.append(
            Problem(
                prompt=str(row[prompt_field]),
                answer=str(row[answer_field]),
                rejected=rejected,
                origin=f"{path}:{number}",
            )
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

    def training_problems(self) -> list[Problem]:
        """Every training problem, in file order."""
        return list(self._train)

    def corpus(self) -> Iterator[str]:
        for problem in self._train + self._eval:
            yield problem.prompt + problem.answer
