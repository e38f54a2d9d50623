"""Reward functions: built-ins, user `module:function` code, and the weighted sum."""

from __future__ import annotations

import math
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlft.trainer.config import RewardFunction, RewardSpec
from rlft.trainer.data.rewards import (
    BUILTIN,
    RewardError,
    RewardModel,
    exact_match,
    format_reward,
    load_reward,
    normalise_answer,
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a uniquely named module into tmp_path, importable for this test only."""

    def write(source: str) -> str:
        name = f"user_rewards_{uuid.uuid4().hex}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    yield write


def spec(*terms: tuple[str, float]) -> RewardSpec:
    return RewardSpec(functions=[RewardFunction(name=n, weight=w) for n, w in terms])


# ----------------------------------------------------------------------- built-ins


@pytest.mark.parametrize(
    ("completion", "answer"),
    [("579", "579"), (" 579\n", "579"), ("579", "  579 "), ("a  b", "a b"), ("a\tb\n", " a b")],
)
def test_exact_match_ignores_whitespace(completion: str, answer: str) -> None:
    assert exact_match(completion, answer) == 1.0


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("578", "579"),
        ("5 79", "579"),
        ("", "579"),
        ("579.0", "579"),
        ("-579", "579"),
        ("ab", "a b"),
    ],
)
def test_exact_match_wrong_answers_score_zero(completion: str, answer: str) -> None:
    assert exact_match(completion, answer) == 0.0


@given(st.text(), st.text(alphabet=" \t\n", max_size=3), st.text(alphabet=" \t\n", max_size=3))
def test_exact_match_padding_property(text: str, left: str, right: str) -> None:
    assert exact_match(left + text + right, text) == 1.0
    assert normalise_answer(left + text + right) == normalise_answer(text)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("579", "579", 1.0),
        ("12", "579", 1.0),  # wrong, but well formed
        (" -3 \n", "-7", 1.0),
        ("3.25", "1.5", 1.0),
        ("579 apples", "579", 0.0),
        ("five", "5", 0.0),
        ("", "5", 0.0),
        ("1 2", "12", 0.0),
        ("Paris", "Paris", 1.0),
        ("Lyon", "Paris", 1.0),
        ("  Paris is big ", "Paris", 1.0),
        ("Paris\nFrance", "Paris", 0.0),
        ("   ", "Paris", 0.0),
        ("", "Paris", 0.0),
    ],
)
def test_format_reward(completion: str, answer: str, expected: float) -> None:
    assert format_reward(completion, answer) == expected


def test_builtins_by_name() -> None:
    assert load_reward("exact_match") is exact_match
    assert load_reward("format") is format_reward
    assert set(BUILTIN) == {"exact_match", "format"}


# ---------------------------------------------------------------------- user code


def test_user_function_is_loaded(user_module) -> None:
    name = user_module(
        """
        def length_bonus(completion, answer):
            return len(completion) / 10
        """
    )
    function = load_reward(f"{name}:length_bonus")
    assert function("abcde", "x") == pytest.approx(0.5)


def test_user_function_in_a_package(user_module, tmp_path: Path) -> None:
    name = user_module("")
    package = tmp_path / f"pkg_{name}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text("def half(c, a):\n    return 0.5\n")
    assert load_reward(f"pkg_{name}.scores:half")("", "") == 0.5


def test_missing_module_is_a_clear_error() -> None:
    module = f"no_such_module_{uuid.uuid4().hex}"
    with pytest.raises(RewardError) as caught:
        load_reward(f"{module}:score")
    message = str(caught.value)
    assert message.startswith("spec.reward.functions: cannot import module")
    assert repr(module) in message
    assert "PYTHONPATH" in message


def test_missing_function_is_a_clear_error(user_module) -> None:
    name = user_module("def other(c, a):\n    return 1.0\n")
    with pytest.raises(RewardError) as caught:
        load_reward(f"{name}:score")
    assert str(caught.value) == (f"spec.reward.functions: module {name!r} has no function 'score'")


def test_non_callable_attribute_is_not_a_function(user_module) -> None:
    name = user_module("score = 3\n")
    with pytest.raises(RewardError, match="has no function 'score'"):
        load_reward(f"{name}:score")


def test_reward_model_loads_at_construction() -> None:
    with pytest.raises(RewardError):
        RewardModel(spec(("exact_match", 1.0), (f"absent_{uuid.uuid4().hex}:f", 1.0)))


# --------------------------------------------------------------------- RewardModel


def test_weighted_sum_and_per_term_values(user_module) -> None:
    name = user_module(
        """
        def brevity(completion, answer):
            return -len(completion.strip())
        """
    )
    model = RewardModel(spec(("exact_match", 2.0), ("format", 0.5), (f"{name}:brevity", 0.25)))
    completions = ["579", " 12 ", "five", "579\n"]
    answers = ["579", "579", "5", "579"]
    scores = model.score(completions, answers)
    assert scores.per_term == {
        "exact_match": [1.0, 0.0, 0.0, 1.0],
        "format": [1.0, 1.0, 0.0, 1.0],
        f"{name}:brevity": [-3.0, -2.0, -4.0, -3.0],
    }
    # 2*em + 0.5*format + 0.25*brevity, written out.
    assert scores.total == pytest.approx([1.75, 0.0, -1.0, 1.75])
    assert all(isinstance(v, float) for values in scores.per_term.values() for v in values)


def test_default_reward_spec_is_exact_match() -> None:
    scores = RewardModel(RewardSpec()).score(["7", "8"], ["7", "7"])
    assert scores.total == [1.0, 0.0]
    assert list(scores.per_term) == ["exact_match"]


def test_negative_weight() -> None:
    scores = RewardModel(spec(("format", -3.0))).score(["12", "x y\nz"], ["1", "1"])
    assert scores.total == [-3.0, 0.0]


def test_integer_return_values_are_floats(user_module) -> None:
    name = user_module("def one(c, a):\n    return 1\n")
    scores = RewardModel(spec((f"{name}:one", 1.5))).score(["a"], ["b"])
    assert scores.total == [1.5]
    assert scores.per_term[f"{name}:one"] == [1.0]
    assert type(scores.per_term[f"{name}:one"][0]) is float


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError):
        RewardModel(RewardSpec()).score(["1", "2"], ["1"])


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ("return float('nan')", "nan"),
        ("return float('inf')", "inf"),
        ("return '1.0'", "'1.0'"),
        ("return None", "None"),
        ("return [1.0]", "[1.0]"),
        # too large for a float: an OverflowError's traceback and exit 1 (retried)
        ("return 10 ** 400", "1" + "0" * 79 + "…"),
        ("return __import__('fractions').Fraction(10 ** 400, 3)", "Fraction(1" + "0" * 70),
    ],
)
def test_unusable_user_values_raise(user_module, body: str, shown: str) -> None:
    name = user_module(f"def bad(completion, answer):\n    {body}\n")
    model = RewardModel(spec(("exact_match", 1.0), (f"{name}:bad", 1.0)))
    with pytest.raises(RewardError) as caught:
        model.score(["579"], ["579"])
    message = str(caught.value)
    assert f"reward '{name}:bad' returned {shown}" in message
    assert "'579'" in message
    assert "finite number" in message


def test_scores_are_finite_for_builtins() -> None:
    scores = RewardModel(spec(("exact_match", 1.0), ("format", 1.0))).score(
        ["", "\n", "1", "x"], ["1", "1", "1", "y"]
    )
    assert all(math.isfinite(v) for v in scores.total)


def test_a_reward_that_raises_is_named(user_module) -> None:
    """A user reward's exception was a bare traceback naming no term of the job."""
    name = user_module("def strict(completion, answer):\n    return float(completion)\n")
    model = RewardModel(spec(("exact_match", 1.0), (f"{name}:strict", 1.0)))
    assert model.score(["1.5"], ["1.5"]).total == [2.5]
    with pytest.raises(RewardError) as caught:
        model.score(["abc"], ["1"])
    message = str(caught.value)
    assert f"reward '{name}:strict' raised ValueError: could not convert" in message
    assert "'abc'" in message


def test_a_reward_whose_call_out_fails_is_retryable_and_a_wrong_one_is_not(user_module) -> None:
    """A judge over the network timing out hours into a run was a permanent failure
    (exit 2, never restarted); a reward that is wrong stays one."""
    name = user_module(
        "def judge(completion, answer):\n"
        "    raise ConnectionError('judge.example.com:443 timed out')\n"
    )
    with pytest.raises(RewardError) as caught:
        RewardModel(spec((f"{name}:judge", 1.0))).score(["1"], ["1"])
    assert caught.value.retryable and "ConnectionError" in str(caught.value)
    wrong = user_module("def strict(completion, answer):\n    return float(completion)\n")
    with pytest.raises(RewardError) as caught:
        RewardModel(spec((f"{wrong}:strict", 1.0))).score(["abc"], ["1"])
    assert not caught.value.retryable


def test_numpy_numbers_are_rewards(user_module) -> None:
    """np.float32 is no float: a reward returning one was refused as not a number."""
    name = user_module(
        "import numpy as np\n"
        "def f32(completion, answer):\n    return np.float32(0.5)\n"
        "def i64(completion, answer):\n    return np.int64(2)\n"
    )
    model = RewardModel(spec((f"{name}:f32", 1.0), (f"{name}:i64", 1.0)))
    assert model.score(["x"], ["y"]).total == [2.5]


def test_a_reward_whose_own_file_is_missing_is_not_retryable(user_module) -> None:
    """A missing or unreadable file of the reward's own fails again on every restart:
    retried, the operator spent the job's restarts on it."""
    name = user_module(
        "def table(completion, answer):\n    open('/nonexistent/rlft/answers.csv')\n"
    )
    with pytest.raises(RewardError) as caught:
        RewardModel(spec((f"{name}:table", 1.0))).score(["1"], ["1"])
    assert not caught.value.retryable and "FileNotFoundError" in str(caught.value)


def test_a_reward_that_exits_is_an_error_not_a_finished_run(user_module) -> None:
    """sys.exit(0) in a reward, or at its module's import (a script's argparse), ended
    the run with exit 0, no model and no message."""
    name = user_module("import sys\ndef bye(completion, answer):\n    sys.exit(0)\n")
    with pytest.raises(RewardError) as caught:
        RewardModel(spec((f"{name}:bye", 1.0))).score(["1"], ["1"])
    assert f"reward '{name}:bye' raised SystemExit" in str(caught.value)
    script = user_module("import sys\nsys.exit(0)\ndef f(completion, answer):\n    return 1.0\n")
    with pytest.raises(RewardError) as caught:
        load_reward(f"{script}:f")
    assert f"importing module {script!r}" in str(caught.value) and "SystemExit" in str(caught.value)


def test_a_module_that_fails_to_import_is_named(user_module) -> None:
    name = user_module("def broken(c, a):\n    return 1.0\nundefined_name + 1\n")
    with pytest.raises(RewardError) as caught:
        load_reward(f"{name}:broken")
    assert f"importing module {name!r} for reward" in str(caught.value)
    assert "NameError" in str(caught.value)


JUDGE_OUT_OF_REACH = """
import socket


def judge(completion, answer):
    # A judge service on a port nobody listens on: the connection is refused for real.
    with socket.create_connection(("127.0.0.1", {port}), timeout=5):
        return 1.0
"""
WRONG_REWARD = """
def judge(completion, answer):
    return completion + 1  # a str plus an int: a TypeError on every call
"""


@pytest.mark.parametrize(
    ("source", "code"), [(JUDGE_OUT_OF_REACH, 1), (WRONG_REWARD, 2)], ids=["unreachable", "wrong"]
)
def test_rlft_train_exits_1_for_a_reward_call_that_failed_and_2_for_a_wrong_reward(
    tmp_path, user_module, source, code
) -> None:
    """The exit code is the operator's failure policy: 1 is restarted within the budget,
    2 fails the job for good. A real `rlft train` whose reward meets a refused connection,
    or raises an error of its own."""
    import socket

    import yaml
    from tiny_jobs import arithmetic_rl_spec, manifest

    from rlft.trainer import termination
    from rlft.trainer.cli.main import main

    with socket.socket() as closed:  # a free port, closed again: nothing listens there
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    name = user_module(source.replace("{port}", str(port)))
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 2}, steps=1)
    spec["reward"] = {"functions": [{"name": f"{name}:judge"}]}
    spec["algorithm"]["sft"] = {"steps": 0}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest(spec)))
    verdict_file = tmp_path / "out.termination"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(termination.ENV, str(verdict_file))
        assert main(["train", str(job), "--out", str(tmp_path / "out")]) == code
    verdict = termination.read(verdict_file.read_text())
    assert verdict is not None and verdict.exit_code == code, verdict
    raised = "ConnectionRefusedError" if code == 1 else "TypeError"
    assert f"reward '{name}:judge' raised {raised}" in verdict.message, verdict


@pytest.mark.parametrize(
    ("terms", "shown"),
    [
        (((1e308, 2.0),), "returned 1e+308, which with weight 2 makes the total reward inf"),
        (((1e308, 1.0), (1e308, 1.0)), "returned 1e+308, which with weight 1 makes the total"),
        (((-1e308, 1.0), (-1e308, 1.0)), "returned -1e+308, which with weight 1 makes the total"),
    ],
    ids=["weighted", "summed", "summed-negative"],
)
def test_a_total_reward_that_overflows_is_refused_naming_the_term(
    user_module, terms: tuple[tuple[float, float], ...], shown: str
) -> None:
    """Each term finite, their weighted sum inf: every step's update was skipped as
    non-finite and `rlft train` ended 0 with an untrained model."""
    source = "".join(
        f"def r{i}(completion, answer):\n    return {v!r}\n" for i, (v, _) in enumerate(terms)
    )
    name = user_module(source)
    model = RewardModel(spec(*((f"{name}:r{i}", w) for i, (_, w) in enumerate(terms))))
    with pytest.raises(RewardError) as caught:
        model.score(["579"], ["579"])
    message = str(caught.value)
    assert message.startswith(f"reward '{name}:r{len(terms) - 1}' {shown}"), message
    assert "for completion '579'" in message
    assert not caught.value.retryable
