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
    published = first["policy_version"]
    assert instance.server.host.policy_version == published
    capsys.readouterr()
    # An earlier committed step than the last (a save due while the previous one still
    # uploads waits for it: under load step 2's can be skipped, leaving 1 and 3).
    folders = (tmp_path / "out" / "checkpoints").glob(f"step-*/{MANIFEST}")
    committed = sorted(int(m.parent.name.removeprefix("step-")) for m in folders)
    steps = job.spec.trainer.steps
    assert committed[-1] == steps, committed
    resumed = committed[-2]
    again = run_job(job, tmp_path / "out", resume=resumed)
    out = capsys.readouterr().out
    assert f"resumed from the checkpoint of step {resumed}" in out
    assert f"continuing at version {published + 1}" in out
    after = published + 1 + steps - resumed  # one optimizer step each after it
    assert again["policy_version"] == after
    assert published + 1 <= instance.server.host.policy_version <= after  # as above
