"""Reward functions by name: `exact_match`, `format`, or user code as `module:function`.

A reward function takes (completion text, reference answer) and returns a float. The
job's reward is the weighted sum of its terms.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlft.trainer.config import RewardSpec

RewardFn = Callable[[str, str], float]

_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


class RewardError(Exception):
    """A reward function that cannot be loaded, raised, or returned something unusable.
    `retryable`: it raised an OSError (a judge it calls over the network timed out, a
    connection dropped), which a restart may not meet again; anything else it would."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


def normalise_answer(text: str) -> str:
    """Whitespace-insensitive form of an answer: strip and collapse inner runs."""
    return " ".join(text.split())


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion is exactly the reference answer (up to whitespace)."""
    return float(normalise_answer(completion) == normalise_answer(answer))


def format_reward(completion: str, answer: str) -> float:
    """1.0 when the completion has the answer's shape: a bare number for numeric answers,
    one non-empty line otherwise. Rewards well-formed output regardless of correctness."""
    text = completion.strip()
    if _NUMBER.match(answer.strip()):
        return float(bool(_NUMBER.match(text)))
    return float(bool(text) and "\n" not in text)


BUILTIN: dict[str, RewardFn] = {"exact_match": exact_match, "format": format_reward}


def load_reward(name: str) -> RewardFn:
    """A built-in reward by name, or `package.module:function` imported from user code."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RewardError(
            f"spec.reward.functions: cannot import module {module_name!r} for reward {name!r} "
            f"({error}); is it installed or on PYTHONPATH?"
        ) from None
    except (Exception, SystemExit) as error:  # its own code failed (a SyntaxError, a
        # NameError…) or exited (a script's top-level argparse): no run "succeeds" on it
        raise RewardError(
            f"spec.reward.functions: importing module {module_name!r} for reward {name!r} "
            f"failed: {type(error).__name__}: {error}"
        ) from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise RewardError(
            f"spec.reward.functions: module {module_name!r} has no function {function_name!r}"
        )
    return function


def _retryable(error: BaseException) -> bool:
    """A reward's error that may pass (a service it calls out of reach), not one of its
    own files missing or refused: those fail again on every restart."""
    permanent = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
    return isinstance(error, OSError) and not isinstance(error, permanent)


def _finite(name: str, value: object, completion: str) -> float:
    """A reward's value as a float, or RewardError (numbers.Real: numpy's scalars too, as
    np.float32 is no float; an int or Fraction too large for a float is no reward)."""
    number = None
    if isinstance(value, numbers.Real):
        with contextlib.suppress(OverflowError, ValueError):
            number = float(value)
    if number is None or not math.isfinite(number):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:80] + "…"
        raise RewardError(
            f"reward {name!r} returned {shown} for completion {completion[:200]!r}; "
            "a reward must be a finite number"
        )
    return number


@dataclass
class Scores:
    total: list[float]
    """Weighted sum per completion."""
    per_term: dict[str, list[float]]
    """Unweighted value of each term per completion."""


class RewardModel:
    """The weighted sum of the job's reward terms."""

    def __init__(self, spec: RewardSpec):
        self.terms = [(f.name, f.weight, load_reward(f.name)) for f in spec.functions]

    def score(self, completions: Sequence[str], answers: Sequence[str]) -> Scores:
        per_term: dict[str, list[float]] = {}
        total = [0.0] * len(completions)
        for name, weight, function in self.terms:
            values = []
            for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
                try:
                    value = function(completion, answer)
                except (Exception, SystemExit) as error:
                    # Named: a bare traceback (or, generating on a thread, "rollout
                    # generation failed") did not say which of the job's terms failed. A
                    # sys.exit(0) in it ended the run with exit 0 and no model.
                    raise RewardError(
                        f"reward {name!r} raised {type(error).__name__}: {error} for "
                        f"completion {completion[:200]!r}",
                        retryable=_retryable(error),
                    ) from error
                value = _finite(name, value, completion)
                values.append(value)
                total[i] += weight * value
                if not math.isfinite(total[i]):
                    # Each term finite, their weighted sum overflowed: every step's update
                    # was then skipped as non-finite, and the run "finished" untrained.
                    raise RewardError(
                        f"reward {name!r} returned {value!r}, which with weight {weight:g} "
                        f"makes the total reward {total[i]!r} for completion "
                        f"{completion[:200]!r}; the weighted sum of the rewards must be a "
                        "finite number"
                    )
            per_term[name] = values
        return Scores(total=total, per_term=per_term)
