"""`local: servers`: the trainer starts its own rollout servers, which start from the
weight store. A run resumed from an earlier checkpoint finds the store holding its
earlier run's later versions: it goes on after the newest, as with the operator's
instances (it used to publish its checkpoint's version and the ones after it again,
rewriting in place folders whose old READY marker said they were complete)."""

from __future__ import annotations

import pytest
from tiny_jobs import arithmetic_rl_spec, write_parity_job

from rlft.trainer.checkpoint.manifest import MANIFEST
from rlft.trainer.config import load_job
from rlft.trainer.run.job import run_job
from rlft.trainer.weights.store import WeightStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_resumed_run_with_its_own_servers_goes_on_past_the_stores_versions(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=3)
    weights = (tmp_path / "weights").as_uri()
    spec["rollout"] |= {"local": "servers", "instances": 1, "weightsUri": weights}
    job = load_job(write_parity_job(tmp_path, spec))
    job.spec.checkpoint.interval_steps = 1
    first = run_job(job, tmp_path / "out")
    published = first["policy_version"]
    store = WeightStore.at(weights)
    assert max(store.numbers()) >= published
    newest = max(store.numbers())
    capsys.readouterr()
    folders = (tmp_path / "out" / "checkpoints").glob(f"step-*/{MANIFEST}")
    committed = sorted(int(m.parent.name.removeprefix("step-")) for m in folders)
    assert committed[-1] == job.spec.trainer.steps, committed
    resumed = committed[-2]
    again = run_job(job, tmp_path / "out", resume=resumed)
    out = capsys.readouterr().out
    assert f"resumed from the checkpoint of step {resumed}" in out
    assert f"continuing at version {newest + 1}" in out
    assert again["policy_version"] == newest + 1 + job.spec.trainer.steps - resumed
