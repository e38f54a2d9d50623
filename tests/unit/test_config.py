"""The job file: loading, defaults, and one `field.path: problem` line per bad field."""

from __future__ import annotations

import copy
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlft.trainer.cli import main as cli
from rlft.trainer.config import (
    API_VERSION,
    KIND,
    JobFileError,
    RLFineTune,
    dump_job,
    load_job,
    parse_job,
)

MINIMAL: dict[str, Any] = {
    "apiVersion": "rlft.dev/v1alpha1",
    "kind": "RLFineTune",
    "metadata": {"name": "tiny"},
    "spec": {"model": {"init": {}}},
}


def manifest(**spec: Any) -> dict[str, Any]:
    """The minimal manifest with `spec` sections replaced or added."""
    document = copy.deepcopy(MINIMAL)
    document["spec"].update(copy.deepcopy(spec))
    return document


def problems(document: Any) -> list[str]:
    with pytest.raises(JobFileError) as caught:
        parse_job(document, "job.yaml")
    assert caught.value.source == "job.yaml"
    assert caught.value.problems, "a JobFileError must name at least one problem"
    return caught.value.problems


def write_yaml(tmp_path: Path, document: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
    return path


# ----------------------------------------------------------------------- good files


def assert_reflected(written: Any, loaded: Any, path: str = "") -> None:
    """Every value written in the file is the value of the loaded job (keys as written)."""
    if isinstance(written, dict):
        assert isinstance(loaded, dict), path
        for key, value in written.items():
            assert key in loaded, f"{path}.{key} was dropped"
            assert_reflected(value, loaded[key], f"{path}.{key}")
    elif isinstance(written, list):
        assert isinstance(loaded, list) and len(loaded) == len(written), path
        for i, (w, got) in enumerate(zip(written, loaded, strict=True)):
            assert_reflected(w, got, f"{path}[{i}]")
    else:
        assert loaded == written, path


def test_example_tiny_grpo_loads(repo_root: Path) -> None:
    path = repo_root / "examples" / "tiny-grpo.yaml"
    job = load_job(path)
    assert job.api_version == API_VERSION
    assert job.kind == KIND
    assert job.metadata.name == "tiny-grpo"
    assert job.spec.model.init is not None and job.spec.model.path is None
    assert job.spec.data.source == "arithmetic"
    assert_reflected(yaml.safe_load(path.read_text()), dump_job(job))


def test_minimal_manifest_gets_defaults() -> None:
    job = parse_job(copy.deepcopy(MINIMAL))
    spec = job.spec
    assert spec.model.path is None
    assert spec.model.init is not None and spec.model.init.family == "qwen3"
    assert spec.model.tokenizer.kind == "bpe"
    assert spec.model.dtype == "float32"
    assert spec.algorithm.name == "grpo"
    assert spec.algorithm.group_size == 8
    assert spec.algorithm.kl.coef == 0.0
    assert spec.algorithm.policy_loss.aggregation == "token-mean"
    assert spec.data.source == "arithmetic"
    assert spec.data.arithmetic.operations == ["+"]
    assert [(f.name, f.weight) for f in spec.reward.functions] == [("exact_match", 1.0)]
    assert spec.trainer.micro_batch_size == 64
    assert (spec.trainer.replicas.min, spec.trainer.replicas.max) == (1, 1)
    assert spec.rollout.engine == "transformers"
    assert spec.checkpoint.uri is None
    assert spec.suspend is False


def test_minimal_manifest_from_file(tmp_path: Path) -> None:
    job = load_job(write_yaml(tmp_path, MINIMAL))
    assert job == parse_job(copy.deepcopy(MINIMAL))


def test_model_path_alone_is_valid() -> None:
    document = manifest(model={"path": "/models/qwen"})
    assert parse_job(document).spec.model.path == "/models/qwen"


def test_scientific_notation_in_yaml_is_a_number(tmp_path: Path) -> None:
    # PyYAML reads `1e-3` (no dot) as a string; the float field must still accept it.
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: rlft.dev/v1alpha1\nkind: RLFineTune\nmetadata: {name: sci}\n"
        "spec:\n  model: {init: {}}\n  trainer: {learningRate: 1e-3}\n"
    )
    assert load_job(path).spec.trainer.learning_rate == pytest.approx(1e-3)


def test_dump_job_round_trips_with_camel_case_keys(repo_root: Path) -> None:
    job = load_job(repo_root / "examples" / "tiny-grpo.yaml")
    document = dump_job(job)
    assert document["spec"]["trainer"]["microBatchSize"] == 256
    assert "micro_batch_size" not in document["spec"]["trainer"]
    assert parse_job(document) == job


def test_good_user_reward_name_is_accepted() -> None:
    job = parse_job(manifest(reward={"functions": [{"name": "my_pkg.rewards:score"}]}))
    assert job.spec.reward.functions[0].name == "my_pkg.rewards:score"


# ------------------------------------------------------------------------ bad files


def test_micro_batch_size_zero_exact_line() -> None:
    assert problems(manifest(trainer={"microBatchSize": 0})) == [
        "spec.trainer.microBatchSize: must be ≥ 1"
    ]


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        pytest.param(
            manifest(trainer={"microbatchSize": 4}),
            "spec.trainer.microbatchSize: unknown field",
            id="unknown-field",
        ),
        pytest.param(
            {**MINIMAL, "apiVersion": "rlft.dev/v1"},
            "apiVersion: must be one of 'rlft.dev/v1alpha1'",
            id="api-version",
        ),
        pytest.param({**MINIMAL, "kind": "Job"}, "kind: must be one of 'RLFineTune'", id="kind"),
        pytest.param(
            manifest(trainer={"env": [{"name": "RLFT_ROLLOUT_URLS", "value": "x"}]}),
            "spec.trainer.env[0]: env RLFT_ROLLOUT_URLS is set by the operator",
            id="env-reserved",
        ),
        pytest.param(
            manifest(rollout={"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
            "spec.rollout.env: env names must be unique; repeated: A",
            id="env-repeated",
        ),
        pytest.param(
            manifest(trainer={"env": [{"name": "NCCL_DEBUG"}]}),
            "spec.trainer.env[0]: env NCCL_DEBUG: give exactly one of value and valueFrom",
            id="env-no-value",
        ),
        pytest.param(
            {**MINIMAL, "metadata": {}}, "metadata.name: required field is missing", id="no-name"
        ),
        pytest.param(
            {**MINIMAL, "metadata": {"name": "Tiny_GRPO"}},
            "metadata.name: must be a DNS-1123 label",
            id="dns-name",
        ),
        pytest.param(
            {**MINIMAL, "metadata": {"name": "-tiny"}},
            "metadata.name: must be a DNS-1123 label",
            id="dns-leading-dash",
        ),
        pytest.param(
            {**MINIMAL, "metadata": {"name": "a" * 64}},
            "metadata.name: string should have at most 63 characters",
            id="dns-too-long",
        ),
        pytest.param(
            {k: v for k, v in MINIMAL.items() if k != "spec"},
            "spec: required field is missing",
            id="no-spec",
        ),
        pytest.param(
            manifest(model={"path": "/m", "init": {}}),
            "spec.model: set exactly one of `path`",
            id="path-and-init",
        ),
        pytest.param(manifest(model={}), "spec.model: set exactly one of `path`", id="no-model"),
        pytest.param(
            manifest(trainer={"replicas": {"min": 3, "max": 2}}),
            "spec.trainer.replicas: min must be ≤ max",
            id="replicas",
        ),
        pytest.param(
            manifest(reward={"functions": [{"name": "accuracy"}]}),
            "spec.reward.functions[0].name: unknown reward 'accuracy'",
            id="reward-name",
        ),
        pytest.param(
            manifest(reward={"functions": [{"name": "pkg.mod:"}]}),
            "spec.reward.functions[0].name: unknown reward 'pkg.mod:'",
            id="reward-name-no-function",
        ),
        pytest.param(
            manifest(reward={"functions": []}),
            "spec.reward.functions: list should have at least 1 item",
            id="no-rewards",
        ),
        pytest.param(
            manifest(checkpoint={"uri": "gs://bucket/prefix"}),
            "spec.checkpoint.uri: must look like s3://bucket/prefix or file:///path",
            id="checkpoint-uri",
        ),
        pytest.param(
            manifest(checkpoint={"uri": "s3://"}),
            "spec.checkpoint.uri: must look like",
            id="checkpoint-uri-no-bucket",
        ),
        pytest.param(
            manifest(rollout={"gpusPerInstance": 6, "tensorParallel": 4}),
            "spec.rollout: gpusPerInstance must be divisible by tensorParallel × expertParallel",
            id="gpus-tp",
        ),
        pytest.param(
            manifest(rollout={"gpusPerInstance": 8, "tensorParallel": 2, "expertParallel": 8}),
            "spec.rollout: gpusPerInstance must be divisible by tensorParallel × expertParallel",
            id="gpus-tp-ep",
        ),
        pytest.param(
            manifest(trainer={"steps": 10_000_001}),
            "spec.trainer.steps: must be ≤ 10000000",
            id="le-int",
        ),
        pytest.param(
            manifest(model={"init": {"hiddenSize": 32768}}),
            "spec.model.init.hiddenSize: must be ≤ 16384",
            id="le-nested",
        ),
        pytest.param(
            manifest(algorithm={"policyLoss": {"clipLow": 1.0}}),
            "spec.algorithm.policyLoss.clipLow: must be < 1",
            id="lt-float",
        ),
        pytest.param(
            manifest(trainer={"learningRate": 0}),
            "spec.trainer.learningRate: must be > 0",
            id="gt-float",
        ),
        pytest.param(
            manifest(rollout={"sampling": {"temperature": 11}}),
            "spec.rollout.sampling.temperature: must be ≤ 10",
            id="le-float",
        ),
        pytest.param(
            manifest(trainer={"steps": "many"}),
            "spec.trainer.steps: input should be a valid integer",
            id="type-int",
        ),
        pytest.param(
            manifest(trainer={"steps": 2.5}),
            "spec.trainer.steps: input should be a valid integer",
            id="type-fraction",
        ),
        pytest.param(
            manifest(trainer={"learningRate": "fast"}),
            "spec.trainer.learningRate: input should be a valid number",
            id="type-float",
        ),
        pytest.param(
            manifest(trainer=[1, 2]),
            "spec.trainer: input should be a valid dictionary",
            id="type-section",
        ),
        pytest.param(
            manifest(reward={"functions": [{"name": "exact_match", "weight": "heavy"}]}),
            "spec.reward.functions[0].weight: input should be a valid number",
            id="list-element-type",
        ),
        pytest.param(
            manifest(
                reward={"functions": [{"name": "exact_match"}, {"name": "format", "weight": 1e4}]}
            ),
            "spec.reward.functions[1].weight: must be ≤ 1000",
            id="list-element-bound",
        ),
        pytest.param(
            manifest(data={"arithmetic": {"operations": ["+", "/"]}}),
            "spec.data.arithmetic.operations[1]: must be one of '+', '-' or '*'",
            id="list-literal",
        ),
        pytest.param(
            manifest(model={"init": {"family": "gpt2"}}),
            "spec.model.init.family: must be one of 'qwen3', 'llama', 'qwen3-moe' or 'mixtral'",
            id="family",
        ),
        pytest.param(
            manifest(model={"init": {"hiddenSize": 30, "numHeads": 4}}),
            "spec.model.init: hiddenSize must be divisible by numHeads",
            id="heads",
        ),
        pytest.param(  # a RoPE model of 15-wide heads: passed, then a traceback, exit 1
            manifest(model={"init": {"hiddenSize": 30, "numHeads": 2, "numKvHeads": 2}}),
            "spec.model.init: hiddenSize / numHeads is the head size, 15: it must be even",
            id="odd-head-size",
        ),
        pytest.param(
            manifest(
                model={"init": {"family": "qwen3-moe", "numExperts": 2, "expertsPerToken": 4}}
            ),
            "spec.model.init: expertsPerToken must be ≤ numExperts",
            id="experts",
        ),
        pytest.param(
            manifest(data={"source": "jsonl"}),
            "spec.data: source `jsonl` needs the `jsonl` section",
            id="jsonl-section",
        ),
        pytest.param(
            manifest(scheduling={"tolerations": [{"operator": "Maybe"}]}),
            "spec.scheduling.tolerations[0].operator: must be one of 'Exists' or 'Equal'",
            id="toleration",
        ),
        pytest.param(
            manifest(checkpoint={"credentialsSecret": "Bad_Name"}),
            "spec.checkpoint.credentialsSecret: 'Bad_Name' is not a DNS-1123 subdomain",
            id="secret-name",
        ),
        pytest.param(
            manifest(scheduling={"priorityClassName": "Not Valid"}),
            "spec.scheduling.priorityClassName: 'Not Valid' is not a DNS-1123 subdomain",
            id="priority-class",
        ),
        pytest.param(
            manifest(scheduling={"nodeSelector": {"bad key!": "v"}}),
            "spec.scheduling.nodeSelector: nodeSelector key 'bad key!' is not a qualified name",
            id="node-selector-key",
        ),
        pytest.param(
            manifest(
                scheduling={"tolerations": [{"key": "a", "operator": "Exists", "value": "x"}]}
            ),
            "spec.scheduling.tolerations[0]: operator Exists takes no value",
            id="toleration-exists-value",
        ),
        pytest.param(
            manifest(scheduling={"tolerations": [{"operator": "Equal", "value": "x"}]}),
            "spec.scheduling.tolerations[0]: a toleration without a key needs operator: Exists",
            id="toleration-no-key",
        ),
        pytest.param(
            manifest(trainer={"image": ""}),
            "spec.trainer.image: string should have at least 1 character",
            id="empty-image",
        ),
        pytest.param(
            manifest(data={"jsonl": {"train": "/data/train.jsonl"}}),
            "spec.data: a `jsonl` section with source `arithmetic` would be ignored",
            id="jsonl-without-source",
        ),
        pytest.param(
            manifest(
                algorithm={"name": "ppo", "groupSize": 1, "dynamicSampling": {"enabled": True}}
            ),
            "spec.algorithm: dynamicSampling keeps groups whose rewards differ",
            id="dynamic-sampling-group-of-one",
        ),
        pytest.param(
            manifest(algorithm={"name": "sft", "kl": {"coef": 0.1}}),
            "spec.algorithm: kl.coef is for the RL algorithms (it has no reference)",
            id="sft-kl",
        ),
        pytest.param(
            manifest(algorithm={"name": "dpo", "kl": {"coef": 0.1}}),
            "spec.algorithm: kl.coef is for the RL algorithms (dpo.beta is its KL weight)",
            id="dpo-kl",
        ),
        pytest.param(
            manifest(algorithm={"name": "dpo", "mismatch": {"mode": "mask"}}),
            "spec.algorithm: mismatch corrects sampled rollouts, which `dpo` does not",
            id="dpo-mismatch",
        ),
        pytest.param(
            manifest(algorithm={"name": "dpo", "dpo": {"loss": "ipo", "labelSmoothing": 0.1}}),
            "spec.algorithm: dpo.labelSmoothing applies to the sigmoid loss, not ipo",
            id="ipo-label-smoothing",
        ),
        pytest.param(
            manifest(stability={"detector": {"entropy": {"window": 10}}}),
            "spec.stability.detector.entropy: minHistory 20 > window 10",
            id="trend-history-beyond-window",
        ),
        pytest.param(
            manifest(stability={"detector": {"sustained": {"criticalCount": 25}}}),
            "spec.stability.detector.sustained: criticalCount 25 > window 20",
            id="sustained-count-beyond-window",
        ),
        pytest.param(
            manifest(rollout={"weightsUri": "gs://bucket/weights"}),
            "spec.rollout.weightsUri: must look like s3://bucket/prefix or file:///path",
            id="weights-scheme",
        ),
        pytest.param(
            manifest(rollout={"weightsUri": "file://weights"}),
            "spec.rollout.weightsUri: a file location is absolute: file:///path",
            id="weights-relative",
        ),
        pytest.param(
            manifest(checkpoint={"uri": "s3://My_Bucket/x"}),
            "spec.checkpoint.uri: must look like s3://bucket/prefix, the bucket 3–63",
            id="checkpoint-bucket",
        ),
        pytest.param(
            manifest(
                model={"init": {"maxPositionEmbeddings": 64}},
                rollout={"sampling": {"maxNewTokens": 200}},
            ),
            "spec: rollout.sampling.maxNewTokens 200 leaves no position for a prompt in the "
            "model's 64 (model.init.maxPositionEmbeddings",
            id="completions-past-the-context",
        ),
        pytest.param(
            manifest(rollout={"sampling": {"maxNewTokens": 512}}),
            "spec: rollout.sampling.maxNewTokens 512 leaves no position for a prompt in the "
            "model's 512 (model.init.maxPositionEmbeddings",
            id="completions-fill-the-default-context",
        ),
        # Each found only once the trainer ran (on Kubernetes: pods made, then exit 2),
        # or, for the penalty, never: every completion was penalised by its length.
        pytest.param(
            manifest(algorithm={"overlong": {"softPenaltyTokens": 16}}),
            "spec: algorithm.overlong.softPenaltyTokens 16 must be below "
            "rollout.sampling.maxNewTokens 16",
            id="soft-penalty-past-the-completion",
        ),
        pytest.param(
            manifest(data={"arithmetic": {"digits": 1, "evalSize": 60}}),
            "spec.data: arithmetic.evalSize: 60 held-out problems leave too few for training "
            "among 100 possible",
            id="eval-size-past-the-problems",
        ),
        pytest.param(
            manifest(data={"jsonl": {"train": ""}}),
            "spec.data.jsonl.train: string should have at least 1 character",
            id="empty-train-path",
        ),
    ],
)
def test_bad_field_is_named(document: dict[str, Any], expected: str) -> None:
    lines = problems(document)
    assert len(lines) == 1, lines
    assert lines[0].startswith(expected), lines


def test_settings_of_a_source_the_job_does_not_use_are_not_judged() -> None:
    """A jsonl job with an arithmetic section left over (say, from a template), and an
    empty held-out path, which means none: both ran, and validation must not refuse
    them now."""
    document = manifest(
        data={
            "source": "jsonl",
            "jsonl": {"train": "/data/train.jsonl", "eval": ""},
            "arithmetic": {"digits": 1},
        }
    )
    assert parse_job(document).spec.data.arithmetic.eval_size == 500


def test_completions_that_leave_a_prompt_room_are_accepted() -> None:
    """One position short of the context is a one-token prompt's room; a `path` model's
    context is only known once it loads, so its maxNewTokens is not bounded here."""
    document = manifest(
        model={"init": {"maxPositionEmbeddings": 64}}, rollout={"sampling": {"maxNewTokens": 63}}
    )
    assert parse_job(document).spec.rollout.sampling.max_new_tokens == 63
    document = manifest(model={"path": "/models/x"}, rollout={"sampling": {"maxNewTokens": 4096}})
    assert parse_job(document).spec.rollout.sampling.max_new_tokens == 4096


def test_unknown_field_line_suggests_camel_case() -> None:
    (line,) = problems(manifest(trainer={"microbatchSize": 4}))
    assert (
        line
        == "spec.trainer.microbatchSize: unknown field (check its spelling; keys are camelCase)"
    )


def test_unknown_top_level_field() -> None:
    assert problems({**MINIMAL, "status": {}}) == [
        "status: unknown field (check its spelling; keys are camelCase)"
    ]


def test_several_problems_give_several_lines() -> None:
    document = manifest(
        trainer={"microBatchSize": 0, "steps": 0, "microbatchSize": 3},
        rollout={"instances": 0},
        checkpoint={"uri": "ftp://x"},
    )
    document["metadata"] = {"name": "Bad Name"}
    lines = problems(document)
    assert len(lines) == 6, lines
    for expected in (
        "metadata.name: must be a DNS-1123 label",
        "spec.trainer.steps: must be ≥ 1",
        "spec.trainer.microBatchSize: must be ≥ 1",
        "spec.trainer.microbatchSize: unknown field",
        "spec.rollout.instances: must be ≥ 1",
        "spec.checkpoint.uri: must look like",
    ):
        assert sum(line.startswith(expected) for line in lines) == 1, (expected, lines)


def test_job_file_error_message_joins_problems() -> None:
    error = JobFileError("a.yaml", ["x: one", "y: two"])
    assert str(error) == "a.yaml: x: one; y: two"
    assert error.problems == ["x: one", "y: two"]


@pytest.mark.parametrize("document", [[1, 2], "text", 42, None], ids=repr)
def test_non_mapping_document(document: Any) -> None:
    assert problems(document) == [
        "(top level): must be a mapping with apiVersion, kind, metadata, spec"
    ]


@pytest.mark.parametrize("text", ["- a\n- b\n", "just words\n", "", "42\n"], ids=repr)
def test_non_mapping_yaml_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(JobFileError) as caught:
        load_job(path)
    assert caught.value.source == str(path)
    assert caught.value.problems == [
        "(top level): must be a mapping with apiVersion, kind, metadata, spec"
    ]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("uri", "s3://AKIAEXAMPLEKEY:wJalrEXAMPLESECRET@minio.local:9000/ckpt"),
        ("endpointUrl", "http://AKIAEXAMPLEKEY:wJalrEXAMPLESECRET@minio.local:9000"),
    ],
)
def test_a_location_holding_credentials_is_refused_without_repeating_them(field, value) -> None:
    lines = problems(manifest(checkpoint={field: value}))
    assert lines == [
        f"spec.checkpoint.{field}: must not hold credentials (user:secret@): give them by "
        "spec.checkpoint.credentialsSecret, credentialsDir or the AWS environment"
    ]
    assert not any("wJalrEXAMPLESECRET" in line or "AKIAEXAMPLEKEY" in line for line in lines)


@pytest.mark.parametrize("endpoint", ["http://minio.local:9000/?region=x", "https://s3.x#frag"])
def test_an_endpoint_with_a_query_or_fragment_is_refused(endpoint) -> None:
    """botocore refused it only at the first request, after a warm start."""
    assert problems(manifest(checkpoint={"uri": "s3://bucket/x", "endpointUrl": endpoint})) == [
        "spec.checkpoint.endpointUrl: must have no query or fragment (?… or #…): "
        "http://host:port or https://host"
    ]


def test_an_otlp_endpoint_with_credentials_is_refused_without_repeating_them() -> None:
    """It is written as it is into the job's ConfigMap and `rlft plan`'s output."""
    lines = problems(manifest(telemetry={"otlpEndpoint": "https://t:SECRETXYZ@otel.example"}))
    assert lines == [
        "spec.telemetry.otlpEndpoint: must hold no credentials, query or fragment (the job "
        "file is a ConfigMap): give the collector's auth header by OTEL_EXPORTER_OTLP_HEADERS "
        "from a Secret"
    ]
    job = parse_job(manifest(telemetry={"otlpEndpoint": "http://otel-collector:4318"}))
    assert job.spec.telemetry.otlp_endpoint == "http://otel-collector:4318"


def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys: the job below ran GRPO with groupSize 8."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "apiVersion: rlft.dev/v1alpha1\nkind: RLFineTune\nmetadata: {name: dup}\nspec:\n"
        "  model: {path: /models/m}\n"
        "  algorithm: {name: ppo, groupSize: 4}\n"
        "  algorithm: {groupSize: 8}\n"
    )
    with pytest.raises(JobFileError) as caught:
        load_job(path)
    assert caught.value.problems == ["line 7: not valid YAML (duplicate key 'algorithm')"]


def test_invalid_yaml_syntax_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: rlft.dev/v1alpha1\nkind: RLFineTune\nmetadata: {name: [x\n")
    with pytest.raises(JobFileError) as caught:
        load_job(path)
    (line,) = caught.value.problems
    assert line.startswith("line ")
    assert "not valid YAML" in line
    assert caught.value.source == str(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(JobFileError) as caught:
        load_job(path)
    assert caught.value.source == str(path)
    assert caught.value.problems == ["cannot read the file: No such file or directory"]


def test_rlfinetune_model_rejects_extra_keys_directly() -> None:
    # parse_job is a thin wrapper: the model itself forbids unknown keys too.
    with pytest.raises(ValueError):
        RLFineTune.model_validate({**MINIMAL, "extra": 1})


# ------------------------------------------------------------------------------ CLI


def test_cli_validate_good_file(repo_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(repo_root / "examples" / "tiny-grpo.yaml")
    assert cli.main(["validate", path]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.strip() == f"{path}: valid RLFineTune 'tiny-grpo'"


def test_cli_validate_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = manifest(
        trainer={"microBatchSize": 0, "microbatchSize": 2}, rollout={"instances": 0}
    )
    path = write_yaml(tmp_path, document)
    assert cli.main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 3, lines
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    assert f"{path}: spec.trainer.microBatchSize: must be ≥ 1" in lines
    assert captured.out == ""


def test_cli_validate_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nope.yaml"
    assert cli.main(["validate", str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"{path}: cannot read the file: No such file or directory"


def test_cli_validate_invalid_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("spec: [\n")
    assert cli.main(["validate", str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}: line ")


def test_cli_train_rejects_max_steps_below_one(
    repo_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(repo_root / "examples" / "tiny-grpo.yaml")
    assert cli.main(["train", path, "--max-steps", "0"]) == 2
    assert "--max-steps must be ≥ 1" in capsys.readouterr().err


def test_cli_train_refuses_resume_with_overwrite(
    repo_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overwrite deletes the checkpoints --resume asks for (it was silently ignored)."""
    path = str(repo_root / "examples" / "tiny-grpo.yaml")
    assert cli.main(["train", path, "--resume", "1", "--overwrite"]) == 2
    assert "--resume 1 with --overwrite: give one of them" in capsys.readouterr().err


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf"])
def test_cli_verify_refuses_a_tolerance_no_gradient_can_be_judged_by(
    repo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tolerance
) -> None:
    """`rlft verify --tolerance -1` (or nan) compared for a minute, then printed `FAIL`
    with every layer `above tolerance`, a verdict on the gradient for a mistyped flag;
    `inf` passed whatever the gradients were."""
    compared: list[float] = []

    def comparison(job, world, micro_batches, tolerance, sequences, fault) -> bool:
        compared.append(tolerance)
        return tolerance >= 0

    monkeypatch.setattr("rlft.trainer.verify.check.verify", comparison)
    path = str(repo_root / "examples" / "tiny-grpo.yaml")
    assert cli.main(["verify", path, "--tolerance", tolerance]) == 2
    assert capsys.readouterr().err.splitlines() == ["rlft: --tolerance must be a finite number ≥ 0"]
    assert compared == []


@pytest.mark.parametrize(
    "uid", ["x y", "'6f1c2a7e-93d4-4b1e-8a52-0c9d3e7b1f20'", "6F1C2A7E-93D4-4B1E-8A52-0C9D3E7B1F20"]
)
def test_cli_plan_refuses_a_uid_no_object_can_have(
    repo_root: Path, capsys: pytest.CaptureFixture[str], uid: str
) -> None:
    """A mistyped --uid (quotes copied along, a stray word) was written into every
    ownerReference: applied, those objects name an owner that does not exist, and
    Kubernetes garbage-collects them."""
    path = str(repo_root / "examples" / "s3-checkpoints.yaml")
    assert cli.main(["plan", path, "--uid", uid]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"rlft: --uid {uid!r} is not a Kubernetes uid (a lower-case UUID); copy the job's "
        "own: kubectl get rlft NAME -o jsonpath='{.metadata.uid}'"
    ]
    good = "6f1c2a7e-93d4-4b1e-8a52-0c9d3e7b1f20"
    assert cli.main(["plan", path, "--uid", good]) == 0
    assert f"uid: {good}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("out", "problem"),
    [("a-file/crd.yaml", "File exists (a-file)"), ("a-folder", "Is a directory (a-folder)")],
)
def test_cli_crd_out_that_cannot_be_written_is_named_not_a_traceback(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    out: str,
    problem: str,
) -> None:
    """`rlft crd --out` under a file, or at a folder, ended in a FileExistsError or
    IsADirectoryError traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("kept\n")
    (tmp_path / "a-folder").mkdir()
    assert cli.main(["crd", "--out", out]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"rlft: --out {out}: {problem}: choose a file path rlft can create and write"
    ]
    assert captured.out == ""
    assert (tmp_path / "a-file").read_text() == "kept\n"
    assert list((tmp_path / "a-folder").iterdir()) == []


def test_cli_train_bad_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_yaml(tmp_path, manifest(trainer={"steps": 0}))
    assert cli.main(["train", str(path), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"{path}: spec.trainer.steps: must be ≥ 1"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("refused", ["job", "max-steps", "resume-with-overwrite"])
def test_a_rank_torchrun_started_leaves_a_refused_jobs_verdict(
    tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str], refused: str
) -> None:
    """torchrun exits 1 whatever its worker returned: a job a rank refused before it ran
    (exit 2) left no verdict, and the operator restarted the gang until its budget ran
    out, with no message in the job's status."""
    from rlft.trainer import termination

    log = tmp_path / "termination"
    for name, value in {
        "TORCHELASTIC_RUN_ID": "r",
        "RANK": "1",
        "WORLD_SIZE": "2",
        termination.ENV: str(log),
    }.items():
        monkeypatch.setenv(name, value)
    good = write_yaml(tmp_path, manifest())
    argv = {
        "job": [str(write_yaml(tmp_path, manifest(trainer={"steps": 0}), "bad.yaml"))],
        "max-steps": [str(good), "--max-steps", "0"],
        "resume-with-overwrite": [str(good), "--overwrite", "--resume", "auto"],
    }[refused]
    assert cli.main(["train", *argv, "--out", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err.strip()
    verdict = termination.read(log.read_text())
    assert verdict is not None and (verdict.exit_code, verdict.rank) == (2, 1)
    assert verdict.message == said.replace("\n", "; ") and said, verdict


# ------------------------------------------------------------------- import hygiene


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_config_and_cli_do_not_import_torch(repo_root: Path) -> None:
    result = run_python(
        "import sys\n"
        "import rlft.trainer.config, rlft.trainer.cli.main\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('clean')\n",
        repo_root,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_repo_operator_folder_does_not_shadow_stdlib(repo_root: Path) -> None:
    result = run_python(
        "import operator, collections, sysconfig\n"
        "print(operator.__file__)\n"
        "print(sysconfig.get_paths()['stdlib'])\n"
        "import rlft.operator, rlft.trainer, rlft.trainer.config\n"
        "print('imported')\n",
        repo_root,
    )
    assert result.returncode == 0, result.stderr
    operator_file, stdlib, imported = result.stdout.splitlines()
    assert Path(operator_file).resolve() == (Path(stdlib) / "operator.py").resolve()
    assert not Path(operator_file).resolve().is_relative_to(repo_root.resolve())
    assert imported == "imported"
    # The same interpreter here sees the same standard library.
    assert Path(stdlib).resolve() == Path(sysconfig.get_paths()["stdlib"]).resolve()


def test_every_python_folder_is_a_listed_package(repo_root: Path) -> None:
    pyproject = tomllib.loads((repo_root / "pyproject.toml").read_text())
    setuptools = pyproject["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    package_dir = setuptools["package-dir"]
    assert package_dir == {"rlft.trainer": "trainer", "rlft.operator": "operator"}
    needed = set()
    for package, folder in package_dir.items():
        root = repo_root / folder
        for source in root.rglob("*.py"):
            relative = source.parent.relative_to(root)
            if "__pycache__" in relative.parts:
                continue
            needed.add(".".join([package, *relative.parts]))
    assert "rlft.trainer.rollout" in needed  # the walk itself works
    missing = sorted(needed - listed)
    assert not missing, f"folders with .py files missing from [tool.setuptools] packages: {missing}"
    for package in listed:
        top = ".".join(package.split(".")[:2])
        rest = package.split(".")[2:]
        assert (repo_root / package_dir[top]).joinpath(*rest).is_dir(), package


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("kind: RLFineTune\n".encode("utf-16"), "line 1: not UTF-8 (byte 0xff); save it as UTF-8"),
        (b"kind: RLFineTune\nname: caf\xe9\n", "line 2: not UTF-8 (byte 0xe9); save it as UTF-8"),
        (b"kind: RLFineTune\n[a, b]: 1\n", "line 2: not valid YAML (found unhashable key)"),
        (b"[" * 3000, "not a job file: nested too deeply"),
    ],
)
def test_a_job_file_that_is_not_yaml_text_is_named_not_a_traceback(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_bytes(content)
    with pytest.raises(JobFileError) as caught:
        load_job(path)
    assert caught.value.problems == [problem]
