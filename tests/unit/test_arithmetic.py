"""Prompt sources: the built-in arithmetic task and JSON Lines files."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlft.trainer.config import ArithmeticTask, DataSpec, JsonlTask
from rlft.trainer.data import Problem, build_task
from rlft.trainer.data.arithmetic import ArithmeticProblems, render, solve
from rlft.trainer.data.jsonl import DataFileError, JsonlProblems, read_problems

PROMPT = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def parse(problem: Problem) -> tuple[int, str, int]:
    match = PROMPT.match(problem.prompt)
    assert match, problem
    return int(match[1]), match[2], int(match[3])


def true_result(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def task(digits: int = 2, operations: tuple[str, ...] = ("+",), eval_size: int = 50, seed: int = 0):
    spec = ArithmeticTask(digits=digits, operations=list(operations), eval_size=eval_size)
    return ArithmeticProblems(spec, seed)


# --------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    ("a", "op", "b", "prompt", "answer"),
    [(12, "+", 7, "12+7=", "19"), (3, "-", 8, "3-8=", "-5"), (0, "*", 99, "0*99=", "0")],
)
def test_render(a: int, op: str, b: int, prompt: str, answer: str) -> None:
    assert render(a, op, b) == Problem(prompt=prompt, answer=answer)


def test_solve_rejects_unknown_operator() -> None:
    with pytest.raises(ValueError, match="unknown operator '/'"):
        solve(1, "/", 2)


@settings(max_examples=30, deadline=None)
@given(
    digits=st.integers(min_value=1, max_value=6),
    operations=st.lists(st.sampled_from(["+", "-", "*"]), min_size=1, max_size=3, unique=True),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_problems_are_correct(digits: int, operations: list[str], seed: int) -> None:
    problems = task(digits, tuple(operations), eval_size=20, seed=seed)
    rng = random.Random(seed)
    drawn = problems.eval_problems() + [problems.train_problem(rng) for _ in range(50)]
    for problem in drawn:
        a, op, b = parse(problem)
        assert op in operations
        assert 0 <= a < 10**digits and 0 <= b < 10**digits
        assert problem.answer == str(true_result(a, op, b))


def test_all_operators_and_widths_appear() -> None:
    problems = task(digits=3, operations=("+", "-", "*"), eval_size=500)
    keys = [parse(p) for p in problems.eval_problems()]
    assert {op for _, op, _ in keys} == {"+", "-", "*"}
    assert max(max(a, b) for a, _, b in keys) >= 900  # operands reach 3 digits
    assert any(p.answer.startswith("-") for p in problems.eval_problems())


def test_eval_problems_are_unique_and_sized() -> None:
    problems = task(digits=2, operations=("+", "-"), eval_size=400)
    held_out = problems.eval_problems()
    assert len(held_out) == 400
    assert len({p.prompt for p in held_out}) == 400


def test_eval_problems_are_deterministic_for_a_seed() -> None:
    first = task(digits=3, eval_size=200, seed=4).eval_problems()
    again = task(digits=3, eval_size=200, seed=4).eval_problems()
    other = task(digits=3, eval_size=200, seed=5).eval_problems()
    assert first == again
    assert first != other
    problems = task(digits=3, eval_size=200, seed=4)
    problems.eval_problems().clear()  # callers get a copy
    assert problems.eval_problems() == first


def test_runs_of_several_seeds_can_share_their_held_out_problems() -> None:
    spec = ArithmeticTask(digits=3, eval_size=200, held_out_seed=7)
    runs = [ArithmeticProblems(spec, seed) for seed in (0, 1, 2)]
    shared = runs[0].eval_problems()
    assert all(run.eval_problems() == shared for run in runs)
    assert shared == task(digits=3, eval_size=200, seed=7).eval_problems()  # the split's seed
    assert shared != task(digits=3, eval_size=200, seed=0).eval_problems()
    held = {p.prompt for p in shared}
    for seed, run in enumerate(runs):
        rng = random.Random(seed)
        assert not held & {run.train_problem(rng).prompt for _ in range(3000)}


def test_train_draws_are_deterministic_for_an_rng_seed() -> None:
    problems = task(digits=3, eval_size=100)
    rng_a, rng_b, rng_c = random.Random(9), random.Random(9), random.Random(10)
    a = [problems.train_problem(rng_a) for _ in range(200)]
    b = [problems.train_problem(rng_b) for _ in range(200)]
    c = [problems.train_problem(rng_c) for _ in range(200)]
    assert a == b
    assert a != c


def test_train_never_draws_held_out_problems() -> None:
    # 1-digit addition: 100 possible problems, half held out. Thousands of draws must
    # avoid all 50 held-out ones and still reach every one of the other 50.
    problems = task(digits=1, eval_size=50, seed=3)
    held_out = {p.prompt for p in problems.eval_problems()}
    assert len(held_out) == 50
    rng = random.Random(0)
    drawn = {problems.train_problem(rng).prompt for _ in range(4000)}
    assert not drawn & held_out
    assert len(drawn) == 50
    assert len(drawn | held_out) == 100


def test_train_never_draws_held_out_problems_larger_space() -> None:
    problems = task(digits=2, operations=("+", "*"), eval_size=2000, seed=1)
    held_out = {p.prompt for p in problems.eval_problems()}
    rng = random.Random(1)
    drawn = [problems.train_problem(rng).prompt for _ in range(3000)]
    assert not set(drawn) & held_out


@pytest.mark.parametrize(
    ("digits", "operations", "eval_size"),
    [(1, ("+",), 51), (1, ("+", "-"), 101), (2, ("*",), 6000)],
)
def test_eval_size_too_large_for_the_space(
    digits: int, operations: tuple[str, ...], eval_size: int
) -> None:
    with pytest.raises(ValueError, match=r"spec\.data\.arithmetic\.evalSize") as caught:
        task(digits, operations, eval_size)
    assert str(eval_size) in str(caught.value)


@pytest.mark.parametrize("exact", [True, False])
def test_operand_widths(exact: bool) -> None:
    spec = ArithmeticTask(digits=2, exact_digits=exact, operations=["+", "-"], eval_size=300)
    problems = ArithmeticProblems(spec, seed=0)
    rng = random.Random(0)
    drawn = problems.eval_problems() + [problems.train_problem(rng) for _ in range(1000)]
    operands = [x for p in drawn for x in parse(p)[::2]]
    assert max(operands) <= 99
    if exact:
        assert min(operands) >= 10  # exactly two digits
    else:
        assert min(operands) < 10  # fewer digits allowed


def test_eval_size_limit_follows_the_operand_range() -> None:
    # Two exact digits: 90 × 90 = 8100 problems, so at most 4050 held out;
    # up to two digits: 100 × 100 = 10000, so 4051 still fits.
    assert (
        len(ArithmeticProblems(ArithmeticTask(digits=2, eval_size=4050), 0).eval_problems()) == 4050
    )
    with pytest.raises(ValueError, match=r"spec\.data\.arithmetic\.evalSize: 4051"):
        ArithmeticProblems(ArithmeticTask(digits=2, eval_size=4051), 0)
    loose = ArithmeticTask(digits=2, exact_digits=False, eval_size=4051)
    assert len(ArithmeticProblems(loose, 0).eval_problems()) == 4051


def test_largest_eval_size_that_fits() -> None:
    problems = task(digits=1, eval_size=50)
    assert len(problems.eval_problems()) == 50


def test_corpus_is_text_of_training_problems() -> None:
    problems = task(digits=2, eval_size=100)
    held_out = {p.prompt + p.answer for p in problems.eval_problems()}
    corpus = list(problems.corpus())
    assert len(corpus) == 2000
    assert all(re.fullmatch(r"\d+\+\d+=\d+", line) for line in corpus)
    assert not set(corpus) & held_out


def test_build_task_arithmetic() -> None:
    built = build_task(DataSpec(arithmetic=ArithmeticTask(digits=1, eval_size=10)), seed=2)
    assert isinstance(built, ArithmeticProblems)
    assert built.eval_problems() == task(digits=1, eval_size=10, seed=2).eval_problems()


# -------------------------------------------------------------------------- jsonl


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_reads_a_file(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "train.jsonl",
        [
            json.dumps({"prompt": "2+2=", "answer": "4"}),
            "",
            json.dumps({"prompt": "capital of France?", "answer": "Paris", "id": 3}),
            json.dumps({"prompt": "7*6=", "answer": 42}),
        ],
    )
    assert read_problems(path, "prompt", "answer") == [
        Problem("2+2=", "4"),
        Problem("capital of France?", "Paris"),
        Problem("7*6=", "42"),
    ]


def test_jsonl_custom_keys_and_task(tmp_path: Path) -> None:
    train = write_lines(
        tmp_path / "train.jsonl", [json.dumps({"q": f"q{i}", "a": f"a{i}"}) for i in range(5)]
    )
    held = write_lines(tmp_path / "eval.jsonl", [json.dumps({"q": "qe", "a": "ae"})])
    spec = DataSpec(
        source="jsonl", jsonl=JsonlTask(train=train, eval=held, prompt_field="q", answer_field="a")
    )
    built = build_task(spec, seed=0)
    assert isinstance(built, JsonlProblems)
    assert built.eval_problems() == [Problem("qe", "ae")]
    rng = random.Random(0)
    drawn = {built.train_problem(rng) for _ in range(200)}
    assert drawn == {Problem(f"q{i}", f"a{i}") for i in range(5)}
    assert sorted(built.corpus()) == sorted([f"q{i}a{i}" for i in range(5)] + ["qeae"])


def test_jsonl_without_eval_file_has_no_eval_problems(tmp_path: Path) -> None:
    train = write_lines(tmp_path / "t.jsonl", [json.dumps({"prompt": "p", "answer": "a"})])
    assert JsonlProblems(JsonlTask(train=train)).eval_problems() == []


def test_jsonl_missing_key_names_file_line_and_key(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "train.jsonl",
        [
            json.dumps({"prompt": "a", "answer": "1"}),
            "",  # blank lines still count as lines
            json.dumps({"prompt": "b", "solution": "2"}),
        ],
    )
    with pytest.raises(DataFileError) as caught:
        read_problems(path, "prompt", "answer")
    message = str(caught.value)
    assert message.startswith(f"{path}:3: key 'answer' is missing or not text")
    assert "spec.data.jsonl.promptField/answerField" in message


def test_jsonl_custom_prompt_key_missing(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps({"prompt": "a", "answer": "1"})])
    with pytest.raises(DataFileError, match=r":1: key 'question' is missing"):
        read_problems(path, "question", "answer")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"prompt": "a", "answer": null}', "key 'answer' is missing or not text"),
        ('{"prompt": ["a"], "answer": "1"}', "key 'prompt' is missing or not text"),
        ('{"prompt": "a", "answer": "1"', "not valid JSON"),
        ('["a", "1"]', "each line must be a JSON object"),
    ],
)
def test_jsonl_bad_lines(tmp_path: Path, line: str, problem: str) -> None:
    path = write_lines(tmp_path / "t.jsonl", [json.dumps({"prompt": "p", "answer": "a"}), line])
    with pytest.raises(DataFileError) as caught:
        read_problems(path, "prompt", "answer")
    assert str(caught.value).startswith(f"{path}:2: {problem}")


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_jsonl_empty_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    with pytest.raises(DataFileError) as caught:
        read_problems(str(path), "prompt", "answer")
    assert str(caught.value) == f"{path}: holds no problems"


def test_jsonl_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(DataFileError) as caught:
        JsonlProblems(JsonlTask(train=str(path)))
    assert str(caught.value).startswith(f"{path}: cannot read")


def test_jsonl_bad_eval_file_is_named(tmp_path: Path) -> None:
    train = write_lines(tmp_path / "t.jsonl", [json.dumps({"prompt": "p", "answer": "a"})])
    held = write_lines(tmp_path / "e.jsonl", [json.dumps({"prompt": "p"})])
    with pytest.raises(DataFileError, match=re.escape(f"{held}:1: key 'answer'")):
        JsonlProblems(JsonlTask(train=train, eval=held))


def test_jsonl_keeps_what_the_file_says(tmp_path: Path) -> None:
    """A line separator inside a JSON string split the line (str.splitlines); a BOM was
    refused; numeric answers were rewritten (1e3 → "1000.0", 3.50 → "3.5", so an exact
    match never matched); a byte that is not UTF-8 was a bare UnicodeDecodeError."""
    path = tmp_path / "data.jsonl"
    rows = [
        '{"prompt": "a\u2028b\u2029c\u0085d", "answer": 1e3}',
        '{"prompt": "price", "answer": 3.50}',
        '{"prompt": "count", "answer": 12}',
    ]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode() + b"\r\n")
    problems = read_problems(str(path), "prompt", "answer")
    assert [p.prompt for p in problems] == ["a\u2028b\u2029c\u0085d", "price", "count"]
    assert [p.answer for p in problems] == ["1e3", "3.50", "12"]
    path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataFileError, match=r"data.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        read_problems(str(path), "prompt", "answer")
    path.write_text('{"prompt": "yes?", "answer": true}\n')
    with pytest.raises(DataFileError, match="key 'answer' is missing or not text or a number"):
        read_problems(str(path), "prompt", "answer")


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            '{"prompt": "a", "answer": "1", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "JSON nested too deeply to read",
        ),
        (
            '{"prompt": "caf\\ud800", "answer": "1"}',
            "key 'prompt' holds \\ud800, half of a UTF-16 surrogate pair, which is no text",
        ),
        (
            '{"prompt": "a", "answer": "\\udc00 1"}',
            "key 'answer' holds \\udc00, half of a UTF-16 surrogate pair, which is no text",
        ),
        ('{"prompt": "", "answer": "1"}', "key 'prompt' is empty; give each line a prompt"),
    ],
    ids=["nested-too-deeply", "lone-high-surrogate", "lone-low-surrogate", "empty-prompt"],
)
def test_jsonl_lines_no_run_could_use_are_named_when_read(
    tmp_path: Path, line: str, problem: str
) -> None:
    """Each passed the reader and failed later: a RecursionError traceback; a TypeError
    traceback from the tokenizer at the first RL step, after the warm start; "every prompt
    needs at least one token" at the first step, naming no file or line."""
    path = write_lines(tmp_path / "t.jsonl", [json.dumps({"prompt": "p", "answer": "a"}), line])
    with pytest.raises(DataFileError) as caught:
        read_problems(path, "prompt", "answer")
    assert str(caught.value).startswith(f"{path}:2: {problem}")


def test_jsonl_escaped_surrogate_pairs_and_blank_prompts_are_text(tmp_path: Path) -> None:
    """A whole escaped pair is one character, and a prompt of a space is a token: both
    stay accepted."""
    path = write_lines(
        tmp_path / "t.jsonl",
        ['{"prompt": "smile \\ud83d\\ude00", "answer": "1"}', '{"prompt": " ", "answer": ""}'],
    )
    problems = read_problems(path, "prompt", "answer")
    assert [(p.prompt, p.answer) for p in problems] == [("smile \U0001f600", "1"), (" ", "")]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            '{"prompt": "2+2=", "answer": "4", "bad": ""}',
            "key 'bad' is empty: DPO would have paired the answer with a made-up wrong one",
        ),
        (
            '{"prompt": "2+2=", "answer": "4", "bad": "4"}',
            "key 'bad' is the answer itself: a pair with no preference in it",
        ),
        (
            '{"prompt": "2+2=", "answer": "4", "answer": "5", "bad": "3"}',
            "key 'answer' is given twice",
        ),
    ],
    ids=["empty-rejected", "rejected-is-the-answer", "duplicate-key"],
)
def test_jsonl_pairs_that_would_teach_nothing_or_something_else_are_named(
    tmp_path: Path, line: str, problem: str
) -> None:
    """An empty rejected answer was replaced, silently, by a nearby wrong one (a pair the
    user never wrote); one equal to the answer gave a pair with no signal; of a key given
    twice the last was taken, silently (job files refuse duplicate keys)."""
    path = write_lines(
        tmp_path / "pairs.jsonl", [json.dumps({"prompt": "p", "answer": "a", "bad": "b"}), line]
    )
    with pytest.raises(DataFileError) as caught:
        read_problems(path, "prompt", "answer", "bad")
    assert str(caught.value).startswith(f"{path}:2: {problem}")
