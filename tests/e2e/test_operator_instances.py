"""On Kubernetes the trainer samples from the rollout instances the operator created
(RLFT_ROLLOUT_URLS), never starting its own: it waits for them, loads the current
weights into them through the weight store, and names an instance that never answers."""

from __future__ import annotations

import socket
import time

import pytest
from rollout_fixtures import ThreadServer
from tiny_jobs import arithmetic_rl_spec, write_parity_job

from rlft.trainer.checkpoint.manifest import MANIFEST
from rlft.trainer.config import load_job
from rlft.trainer.rollout.client import NoInstanceError
from rlft.trainer.run.job import run_job
from rlft.trainer.weights.store import WeightStore

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def instance():
    server = ThreadServer()
    yield server
    server.stop()


def _job(tmp_path, scheduling: dict | None = None, **rollout):
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=3)
    spec["rollout"] |= {"weightsUri": (tmp_path / "weights").as_uri(), **rollout}
    if scheduling:
        spec["scheduling"] = scheduling
    return load_job(write_parity_job(tmp_path, spec))


def test_the_trainer_uses_the_instances_it_is_given(tmp_path, monkeypatch, instance, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RLFT_ROLLOUT_URLS", instance.url)
    summary = run_job(_job(tmp_path), tmp_path / "out")
    assert summary["steps"] == 3
    out = capsys.readouterr().out
    assert f"1 rollout server(s) (operator-created) at {instance.url}" in out
    # The instance started empty; it now serves weights the trainer published. Not
    # always the newest: a version still pending when the run closes its publisher is
    # not shipped (under load the last one can be).
    assert 1 <= instance.server.host.policy_version <= summary["policy_version"]
    assert not list((tmp_path / "out").glob("rollout-*.log"))  # no local servers started


def test_an_instance_that_never_answers_is_named(tmp_path, monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RLFT_ROLLOUT_URLS", dead)
    # The wait is as long as the operator's pods may take to be placed and start (it was
    # requestTimeoutSeconds: a large model's vLLM loading past it cost a restart).
    job = _job(
        tmp_path,
        {"schedulingTimeoutSeconds": 1},
        requestTimeoutSeconds=2,
        startupTimeoutSeconds=10,
    )
    started = time.monotonic()
    with pytest.raises(NoInstanceError, match=rf"rollout instance 0 \({dead}\) did not answer"):
        run_job(job, tmp_path / "out")
    assert time.monotonic() - started >= 11


def test_a_resumed_run_goes_on_past_the_versions_its_instances_were_given(
    tmp_path, monkeypatch, instance, capsys
):
    """Rollout instances outlive a trainer: a run resumed from an earlier checkpoint
    finds them (and the store) at versions past it. It goes on after the newest, so no
    number names two sets of weights (it used to publish its checkpoint's version again,
    then train to the same numbers with other weights)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RLFT_ROLLOUT_URLS", instance.url)
    job = _job(tmp_path)
    job.spec.checkpoint.interval_steps = 1
    first = run_job(job, tmp_path / "out")
    # The newest version shipped: the last one may still have been pending as the run
    # closed its publisher (under load it can be), and then it went nowhere.
    store = WeightStore.at((tmp_path / "weights").as_uri())
    newest = max([*store.numbers(), instance.server.host.policy_version])
    assert first["policy_version"] - 1 <= newest <= first["policy_version"]
    capsys.readouterr()
    # The first committed step (a save due while the previous one still uploads is
    # skipped: under load step 2's can be, leaving 1 and 3), below any version shipped.
    folders = (tmp_path / "out" / "checkpoints").glob(f"step-*/{MANIFEST}")
    committed = sorted(int(m.parent.name.removeprefix("step-")) for m in folders)
    steps = job.spec.trainer.steps
    assert committed[0] == 1 and committed[-1] == steps, committed
    resumed = committed[0]
    again = run_job(job, tmp_path / "out", resume=resumed)
    out = capsys.readouterr().out
    assert f"resumed from the checkpoint of step {resumed}" in out
    assert f"continuing at version {newest + 1}" in out
    after = newest + 1 + steps - resumed  # one optimizer step each after it
    assert again["policy_version"] == after
    assert newest + 1 <= instance.server.host.policy_version <= after  # as above


def test_a_replaced_gang_still_running_cannot_load_weights_into_the_new_ones_instances(
    tmp_path, monkeypatch, instance
):
    """The operator replaced a trainer gang whose node stopped reporting; cut off from the
    API server but not from the rollout pods, the old gang trained on and pushed its
    weights into the new gang's instances (its versions interleaving with the new one's).
    An instance that took weights from gang attempt 3 refuses attempt 1's (409), and the
    old trainer stops with exit 1 and a verdict that says why."""
    from rollout_fixtures import publish, store_at, tiny_model

    from rlft.trainer import termination
    from rlft.trainer.cli.main import main
    from rlft.trainer.rollout.client import http_json
    from rlft.trainer.rollout.protocol import WeightsRequest

    model, _ = tiny_model(seed=0)
    uri = publish(store_at(tmp_path / "new-gang"), model, 0)
    http_json(f"{instance.url}/weights", WeightsRequest(0, uri, gang=3).to_json(), 60)
    assert instance.server.host.gang == 3
    _job(tmp_path)  # writes job.yaml (and its reward) there
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RLFT_ROLLOUT_URLS", instance.url)
    monkeypatch.setenv("RLFT_GANG_ATTEMPT", "1")
    monkeypatch.setenv(termination.ENV, str(tmp_path / "old.termination"))
    job_file = tmp_path / "job.yaml"
    assert main(["train", str(job_file), "--out", str(tmp_path / "out")]) == 1
    verdict = termination.read((tmp_path / "old.termination").read_text())
    assert verdict is not None and verdict.exit_code == 1, verdict
    assert "gang attempt 1 refused: gang attempt 3 of this job has replaced it" in (verdict.message)
    assert instance.server.host.policy_version == 0  # still the new gang's weights
