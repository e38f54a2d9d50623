"""Every problem of a job's data must fit the model's context: refused at the start,
naming the line, rather than at the step that draws it (a rollout server's 400, then a
restart that draws it again; the in-process engine sampling at untrained positions)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from tiny_jobs import TINY_MODEL, manifest

from rlft.trainer.config import parse_job
from rlft.trainer.data.jsonl import DataFileError
from rlft.trainer.run.parts import build_parts

POSITIONS = 64
SHORT = {"prompt": "2+2=", "answer": "4", "rejected": "5"}


def _job(tmp_path: Path, algorithm: str, rows: list[dict[str, str]], new_tokens: int) -> Any:
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = copy.deepcopy(TINY_MODEL)
    model["init"]["maxPositionEmbeddings"] = POSITIONS
    jsonl = {"train": str(train), **({"rejectedField": "rejected"} if algorithm == "dpo" else {})}
    spec = {
        "model": model,
        "data": {"source": "jsonl", "jsonl": jsonl},
        "algorithm": {"name": algorithm},
        "rollout": {"sampling": {"maxNewTokens": new_tokens}},
        "telemetry": {"enabled": False},
    }
    return parse_job(manifest(spec, name="context"))


def test_a_prompt_past_the_context_with_its_completion_is_refused_naming_its_line(tmp_path):
    long = {"prompt": " ".join(str(n) for n in range(200)) + "=", "answer": "1"}
    job = _job(tmp_path, "grpo", [SHORT, SHORT, long], new_tokens=8)
    with pytest.raises(DataFileError) as refused:
        build_parts(job)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'train.jsonl'}:3: the prompt's "), message
    assert f"rollout.sampling.maxNewTokens 8 exceed the model's {POSITIONS} positions" in message


def test_a_prompt_that_fits_only_without_the_completion_is_refused(tmp_path):
    """The prompt alone fits; its completion would run past the last position."""
    job = _job(tmp_path, "grpo", [SHORT], new_tokens=POSITIONS - 2)
    with pytest.raises(DataFileError, match=r"train.jsonl:1: the prompt's \d+ tokens"):
        build_parts(job)
    job = _job(tmp_path, "grpo", [SHORT], new_tokens=8)
    assert build_parts(job).encoder.prompt(SHORT["prompt"])


@pytest.mark.parametrize("algorithm", ["sft", "dpo"])
def test_a_supervised_answer_past_the_context_is_refused(tmp_path, algorithm):
    """Offline algorithms train on the answers themselves: their tokens count, not
    maxNewTokens (a long chosen or rejected answer alike)."""
    key = "rejected" if algorithm == "dpo" else "answer"
    long = {**SHORT, key: " ".join(str(n) for n in range(200))}
    job = _job(tmp_path, algorithm, [SHORT, long], new_tokens=4)
    with pytest.raises(DataFileError, match=r"train.jsonl:2: .* its longest answer's \d+ tokens"):
        build_parts(job)


def test_held_out_problems_past_eval_max_problems_are_not_checked(tmp_path):
    """Evaluation reads the first eval.maxProblems of the file: only those are generated."""
    job = _job(tmp_path, "grpo", [SHORT], new_tokens=8)
    held_out = tmp_path / "eval.jsonl"
    long = {"prompt": " ".join(str(n) for n in range(200)) + "=", "answer": "1"}
    held_out.write_text(json.dumps(SHORT) + "\n" + json.dumps(long) + "\n")
    document = job.model_dump(by_alias=True, exclude_none=True)
    document["spec"]["data"]["jsonl"]["eval"] = str(held_out)
    document["spec"]["eval"] = {"maxProblems": 1}
    assert build_parts(parse_job(document)).task.eval_problems()[1].origin.endswith(":2")
    document["spec"]["eval"] = {"maxProblems": 2}
    with pytest.raises(DataFileError, match=r"eval.jsonl:2: the prompt's"):
        build_parts(parse_job(document))


def test_a_rollout_jobs_warm_start_answers_are_checked(tmp_path):
    """GRPO with a supervised warm start trains on the reference answers first."""
    long = {**SHORT, "answer": " ".join(str(n) for n in range(200))}
    document = _job(tmp_path, "grpo", [SHORT, long], new_tokens=8).model_dump(
        by_alias=True, exclude_none=True
    )
    document["spec"]["algorithm"]["sft"] = {"steps": 0}
    assert build_parts(parse_job(document))  # no warm start: no answer is trained on
    document["spec"]["algorithm"]["sft"] = {"steps": 2}
    with pytest.raises(DataFileError, match=r"train.jsonl:2: .* its longest answer's"):
        build_parts(parse_job(document))


def test_a_rope_scaled_models_context_is_its_scaled_one():
    """YaRN and the like extend the trained context by their factor (vLLM serves as many
    positions): a prompt past max_position_embeddings but within that is no error."""
    from transformers import Qwen3Config

    from rlft.trainer.run.parts import context_positions

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert context_positions(Qwen3Config(max_position_embeddings=64, rope_scaling=scaling)) == 256
    assert context_positions(Qwen3Config(max_position_embeddings=64)) == 64
    assert context_positions(None) is None


@pytest.mark.parametrize("algorithm", ["grpo", "sft"])
def test_the_arithmetic_tasks_longest_problem_is_checked_with_its_answer(algorithm):
    """12-digit products need 51 positions (a 26-token prompt, 24 digits and the end of
    text): with 34 the warm start (or sft) trained past the context, unchecked; the same
    problems as a JSON Lines file were refused."""
    model = copy.deepcopy(TINY_MODEL)
    model["init"]["maxPositionEmbeddings"] = 34
    spec = {
        "model": model,
        "data": {"arithmetic": {"digits": 12, "operations": ["*"], "evalSize": 20}},
        "algorithm": {"name": algorithm, "sft": {"steps": 3}},
        "rollout": {"sampling": {"maxNewTokens": 4}},
        "telemetry": {"enabled": False},
    }
    with pytest.raises(DataFileError) as refused:
        build_parts(parse_job(manifest(spec, name="context")))
    message = str(refused.value)
    assert message.startswith("spec.data.arithmetic: 999999999999*999999999999=: the prompt's")
    assert "its longest answer's 25 tokens exceed the model's 34 positions: lower " in message


def test_the_widest_negative_difference_is_checked_with_exact_digits_off():
    """With operands from 0, `-`'s longest problem is not `0-999999=`: `100000-999999=`
    has the widest prompt and a negative answer (22 positions with its end of text)."""
    model = copy.deepcopy(TINY_MODEL)
    spec = {
        "model": model,
        "data": {"arithmetic": {"digits": 6, "exactDigits": False, "operations": ["-"]}},
        "algorithm": {"name": "sft"},
        "rollout": {"sampling": {"maxNewTokens": 4}},
        "telemetry": {"enabled": False},
    }
    model["init"]["maxPositionEmbeddings"] = 21
    with pytest.raises(DataFileError, match=r"^spec.data.arithmetic: 100000-999999=: "):
        build_parts(parse_job(manifest(spec, name="context")))
    model["init"]["maxPositionEmbeddings"] = 22
    assert build_parts(parse_job(manifest(spec, name="context")))


def test_a_made_up_rejected_answer_is_checked_at_its_longest(tmp_path):
    """DPO without a rejected answer pairs the answer with a nearby wrong one that may be a
    character longer ("5" against "-5" or "15"): a context that fits "5" exactly is refused."""
    prompt = "1+1+1+1+1+1+1+1+1+1="  # long enough for the least context a model may have
    job = _job(tmp_path, "dpo", [{"prompt": prompt, "answer": "5"}], new_tokens=4)
    document = job.model_dump(by_alias=True, exclude_none=True)
    del document["spec"]["data"]["jsonl"]["rejectedField"]
    encoder = build_parts(parse_job(document)).encoder
    fits_answer = len(encoder.prompt(prompt)) + len(encoder.answer("5"))
    assert len(encoder.answer("-5")) > len(encoder.answer("5"))
    document["spec"]["model"]["init"]["maxPositionEmbeddings"] = fits_answer
    with pytest.raises(DataFileError, match=r"train.jsonl:1: .* its longest answer's"):
        build_parts(parse_job(document))
    document["spec"]["model"]["init"]["maxPositionEmbeddings"] = fits_answer + 1
    assert build_parts(parse_job(document))
