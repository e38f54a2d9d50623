"""A run with a checkpoint location keeps its outputs there: the final model, metrics.jsonl
and summary.json outlive the folder it ran in (on Kubernetes, a pod's emptyDir)."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_fixtures import s3_options
from tiny_jobs import arithmetic_rl_spec, write_parity_job
from transformers import AutoModelForCausalLM

from rlft.trainer.config import load_job
from rlft.trainer.run.job import run_job
from rlft.trainer.storage.backends import open_storage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_outputs_are_kept_under_the_checkpoint_location(tmp_path, monkeypatch, bucket, s3_env):
    uri = f"s3://{bucket}/runs/kept"
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=3)
    spec["checkpoint"] = {"uri": uri, "endpointUrl": s3_env.endpoint, "addressingStyle": "path"}
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "pod-emptydir"
    summary = run_job(load_job(write_parity_job(tmp_path, spec)), out)
    assert summary["outputs_uri"] == f"{uri}/outputs"

    storage = open_storage(uri, s3_options(s3_env))
    keys = {info.key for info in storage.list("outputs/")}
    assert {"outputs/metrics.jsonl", "outputs/summary.json", "outputs/model/config.json"} <= keys
    kept = tmp_path / "kept"
    for key in keys:
        storage.get_file(key, kept / key.removeprefix("outputs/"))
    assert json.loads((kept / "summary.json").read_text()) == summary
    assert (kept / "metrics.jsonl").read_text() == (out / "metrics.jsonl").read_text()
    model = AutoModelForCausalLM.from_pretrained(kept / "model")
    local = AutoModelForCausalLM.from_pretrained(out / "model")
    for (name, value), (_, expected) in zip(
        model.state_dict().items(), local.state_dict().items(), strict=True
    ):
        assert torch.equal(value, expected), name
