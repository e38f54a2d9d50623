"""A run with a checkpoint location keeps its outputs there: the final model, metrics.jsonl
and summary.json outlive the folder it ran in (on Kubernetes, a pod's emptyDir)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from checkpoint_fixtures import s3_options
from tiny_jobs import arithmetic_rl_spec, write_parity_job
from transformers import AutoModelForCausalLM

from rlft.trainer.cli.main import main as rlft
from rlft.trainer.config import load_job
from rlft.trainer.model.construct import from_pretrained
from rlft.trainer.run import job as job_module
from rlft.trainer.run.job import run_job
from rlft.trainer.storage.backends import open_storage

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _same_weights(a, b) -> None:
    for (name, value), (_, expected) in zip(
        a.state_dict().items(), b.state_dict().items(), strict=True
    ):
        assert torch.equal(value, expected), name


def test_outputs_are_kept_under_the_checkpoint_location(
    tmp_path, monkeypatch, bucket, s3_env, capsys
):
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
    model = from_pretrained(AutoModelForCausalLM, kept / "model")
    local = from_pretrained(AutoModelForCausalLM, out / "model")
    _same_weights(model, local)

    # `rlft export` of the location gives the final model, not the latest checkpoint...
    flags = ["--endpoint-url", s3_env.endpoint, "--addressing-style", "path"]
    assert rlft(["export", uri, str(tmp_path / "final"), *flags]) == 0
    assert "exported the final model (outputs/model/)" in capsys.readouterr().out
    _same_weights(from_pretrained(AutoModelForCausalLM, tmp_path / "final"), local)
    # ...unless asked for the checkpoint; and without a summary (publication cut short)
    # the outputs are not trusted and the latest checkpoint is used.
    assert rlft(["export", uri, str(tmp_path / "ckpt"), "--latest-checkpoint", *flags]) == 0
    assert "exported step-000003" in capsys.readouterr().out
    storage.delete_prefix("outputs/summary.json")
    assert rlft(["export", uri, str(tmp_path / "partial"), *flags]) == 0
    assert "exported step-000003" in capsys.readouterr().out


def test_outputs_published_again_replace_the_earlier_ones_whole(tmp_path, monkeypatch):
    """A second run at the location (a resumed one, another model) publishes its outputs:
    the earlier summary is withdrawn before any of its model files change, and files of
    the earlier model that the new one has not are gone. An export in between used to
    take a mix (the new config.json with the old shards)."""
    location = tmp_path / "location"
    spec = SimpleNamespace(
        checkpoint=load_job(write_parity_job(tmp_path, _file_spec(location))).spec.checkpoint
    )

    def publish(out, model_files):
        for name, text in model_files.items():
            (out / "model" / name).parent.mkdir(parents=True, exist_ok=True)
            (out / "model" / name).write_text(text)
        (out / "metrics.jsonl").write_text("{}\n")
        (out / "summary.json").write_text(json.dumps({"run": out.name}))
        job_module._publish_outputs(SimpleNamespace(spec=spec, out=out))

    storage = open_storage(f"file://{location}")
    publish(
        tmp_path / "first",
        {"config.json": "1", "model-1.safetensors": "a", "model-2.safetensors": "b"},
    )
    seen = []
    put_file = type(storage).put_file

    def watched(self, key, path, **kwargs):
        seen.append((key, self.exists("outputs/summary.json")))
        return put_file(self, key, path, **kwargs)

    monkeypatch.setattr(type(storage), "put_file", watched)
    publish(tmp_path / "second", {"config.json": "2", "model.safetensors": "c"})
    assert [present for key, present in seen if key.startswith("outputs/model/")] == [False, False]
    keys = sorted(i.key for i in storage.list("outputs/model/"))
    assert keys == ["outputs/model/config.json", "outputs/model/model.safetensors"]
    assert json.loads(storage.get_bytes("outputs/summary.json")) == {"run": "second"}


def _file_spec(location) -> dict:
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=1)
    spec["checkpoint"] = {"uri": f"file://{location}"}
    return spec
