"""Every algorithm end to end through the real CLI, multi-rank training with --nproc, MoE
expert-load metrics, and `rlft verify` on the example job (real torchrun gloo ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny_jobs import MOE_INIT, TINY_INIT, arithmetic_rl_spec, write_parity_job

REPO_ROOT = Path(__file__).resolve().parents[2]
RLFT = [sys.executable, "-m", "rlft.trainer.cli.main"]


def write_job(
    folder: Path, algorithm: dict, init: dict = TINY_INIT, steps: int = 3, **trainer
) -> Path:
    spec = arithmetic_rl_spec(algorithm, steps, init)
    spec["trainer"] |= trainer
    return write_parity_job(folder, spec, "algorithms")


def rlft(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(cwd), OMP_NUM_THREADS="1")
    return subprocess.run(
        [*RLFT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("algorithm", "expected"),
    [
        ({"name": "rloo", "groupSize": 4}, {"clip_fraction", "ratio_max"}),
        ({"name": "reinforce++", "groupSize": 2}, {"clip_fraction"}),
        (
            {"name": "ppo", "groupSize": 2, "kl": {"coef": 0.05, "placement": "reward"}},
            {"value_loss"},
        ),
        ({"name": "dpo", "dpo": {"pairsPerStep": 8}}, {"margin_mean", "preference_accuracy"}),
        ({"name": "sft"}, {"loss"}),
        (
            {
                "name": "grpo",
                "groupSize": 4,
                "dynamicSampling": {"enabled": True, "maxRounds": 2},
                "mismatch": {"mode": "truncate"},
                "kl": {"coef": 0.1, "estimator": "k2"},
            },
            {"groups_kept", "sampling_rounds", "is_weight_mean", "kl", "ratio_truncated_fraction"},
        ),
    ],
    ids=["rloo", "reinforce++", "ppo", "dpo", "sft", "dapo-tis-k2"],
)
def test_each_algorithm_runs_and_reports_its_metrics(tmp_path, algorithm, expected) -> None:
    ppo = algorithm["name"] == "ppo"
    job = write_job(tmp_path, algorithm, **({"warmupSteps": 3} if ppo else {}))
    result = rlft("train", str(job), "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "out")
    assert [r["step"] for r in records] == [1, 2, 3]
    if ppo:  # the critic warms up with the policy (it ran at its peak from step 1)
        peak = records[-1]["lr"]
        assert [r["critic_lr"] for r in records] == [
            pytest.approx(1e-3 * r["lr"] / peak) for r in records
        ]
        assert records[0]["critic_lr"] == pytest.approx(1e-3 / 3)
    applied = [r for r in records if r["update_applied"]]
    assert applied, records
    for record in applied:
        assert expected <= record.keys(), expected - record.keys()
    if algorithm["name"] not in ("dpo", "sft"):  # completions received (the alert's base)
        assert all(r["samples"] >= 8 for r in records), records
    assert any(record["grad_norm"] > 0 for record in applied), records
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["algorithm"] == algorithm["name"]
    if algorithm["name"] == "dpo":
        assert 0 <= summary["eval_preference_accuracy_final"] <= 1


def test_two_ranks_train_like_one(tmp_path) -> None:
    """`--nproc 2` (FSDP2 over gloo) follows the single-process run step for step."""
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    one = rlft("train", str(job), "--out", "one", cwd=tmp_path)
    two = rlft("train", str(job), "--out", "two", "--nproc", "2", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 ranks (FSDP2)" in two.stdout
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two"), strict=True):
        assert a["reward_mean"] == b["reward_mean"]  # the same samples
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-7)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    assert any(r["grad_norm"] > 0 for r in metrics(tmp_path / "one"))
    for run in ("one", "two"):  # per-group norms (before clipping) make up the whole norm
        for record in metrics(tmp_path / run):
            groups = record["grad_norm_groups"]
            assert {"embeddings", "layer_000", "layer_001", "final_norm"} <= groups.keys()
            total = sum(v * v for v in groups.values()) ** 0.5
            assert total == pytest.approx(record["grad_norm"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_gspo_trains_and_reports_expert_load(tmp_path, family) -> None:
    moe = MOE_INIT | {"family": family}
    algorithm = {
        "name": "grpo",
        "groupSize": 4,
        "policyLoss": {
            "ratioLevel": "sequence",
            "aggregation": "seq-mean-token-mean",
            "clipLow": 0.0003,
            "clipHigh": 0.0004,
        },
        "moe": {"routerAuxCoef": 0.01},
    }
    spec = arithmetic_rl_spec(algorithm, 3, moe)
    spec["telemetry"] = {"expertLoadEverySteps": 2}
    job = write_parity_job(tmp_path, spec, "algorithms")
    result = rlft("train", str(job), "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "out")
    for record in records:
        assert len(record["expert_imbalance"]) == 2  # one per layer
        assert record["expert_imbalance_max"] >= 1.0
        assert 0.0 <= record["expert_dead_fraction"] <= 1.0
    # The whole matrix on the first step and every expertLoadEverySteps, not every line.
    assert [r["step"] for r in records if "expert_load" in r] == [1, 2], records
    for record in records[:2]:
        for layer in record["expert_load"]:
            assert len(layer) == 4 and sum(layer) == pytest.approx(1.0)


def test_verify_passes_on_the_example_and_catches_a_planted_bug(tmp_path) -> None:
    example = str(REPO_ROOT / "examples" / "tiny-grpo.yaml")
    # float64's rounding (1e-15), far under the default tolerance: a float32 step left in
    # the float64 model would show here as 1e-8.
    args = ("--world-size", "2", "--micro-batches", "4", "--tolerance", "1e-12")
    good = rlft("verify", example, *args, cwd=tmp_path)
    assert good.returncode == 0, good.stdout + good.stderr[:6000]
    assert "PASS" in good.stdout and "layer 0 self_attn" in good.stdout
    bad = rlft(
        "verify",
        example,
        "--world-size",
        "2",
        "--micro-batches",
        "4",
        "--sequences",
        "16",
        "--inject-fault",
        "per-micro-batch-normaliser",
        cwd=tmp_path,
    )
    assert bad.returncode == 1, bad.stdout + bad.stderr[-3000:]
    assert "FAIL" in bad.stdout and "above tolerance" in bad.stdout


def test_two_ranks_with_bf16_and_activation_checkpointing(tmp_path) -> None:
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["parallelism"] = {
        "mixedPrecision": "bf16",
        "activationCheckpointing": True,
        "reshardAfterForward": False,
    }
    job.write_text(yaml.safe_dump(spec))
    result = rlft("train", str(job), "--out", "out", "--nproc", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = metrics(tmp_path / "out")
    assert len(records) == 3 and all(r["update_applied"] for r in records)
    assert any(r["grad_norm"] > 0 for r in records)
