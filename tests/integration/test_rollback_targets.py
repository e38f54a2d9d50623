"""Where a collapse rollback goes: the newest intact healthy checkpoint before the
collapse on the run's own timeline, never an unhealthy one (restoring it would restore
the collapse), never one a `--resume N` or an earlier rollback abandoned, and an error
naming the damage when no healthy one is intact. A real run's checkpoint handling
(Checkpointing, Learner, Supervisor) saving real checkpoints on file://, one of them then
damaged on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import corrupt
from tiny_jobs import TINY_MODEL, manifest

from rlft.trainer.checkpoint import NoCheckpointError
from rlft.trainer.checkpoint.manifest import FRESH_START
from rlft.trainer.config import parse_job
from rlft.trainer.distributed import Dist
from rlft.trainer.learner.learner import Learner
from rlft.trainer.run.checkpointing import Checkpointing
from rlft.trainer.run.parts import build_parts
from rlft.trainer.run.state import Cursor
from rlft.trainer.run.supervisor import Supervisor
from rlft.trainer.stability.actions import Counters

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# step → whether the guard let the checkpoint be tagged healthy
SAVED = {10: True, 20: False, 30: True}


@pytest.fixture
def saved_run(tmp_path: Path, monkeypatch, one_torch_thread):
    """A run that checkpointed SAVED, with distinct weights at each step: (checkpoints,
    learner, cursor, {step: the policy's parameters then}, a function starting the next
    run's checkpoint handling on the same location and closing this one's)."""
    yield from _saved_run({"uri": f"file://{tmp_path}/ckpts"}, tmp_path, monkeypatch)


@pytest.fixture
def saved_run_behind_a_proxy(bucket, store_proxy, tmp_path: Path, monkeypatch, one_torch_thread):
    """`saved_run` on a real SeaweedFS bucket reached through a proxy that can refuse
    requests: (the proxy, then what `saved_run` yields)."""
    checkpoint = {"uri": f"s3://{bucket}/ckpts", "endpointUrl": store_proxy.url}
    checkpoint["addressingStyle"] = "path"
    for run in _saved_run(checkpoint, tmp_path, monkeypatch):
        yield store_proxy, run


def _saved_run(checkpoint: dict, tmp_path: Path, monkeypatch):
    job = parse_job(
        manifest(
            {
                "model": TINY_MODEL,
                "telemetry": {"enabled": False},
                "checkpoint": {**checkpoint, "intervalSteps": 10},
            }
        )
    )
    parts = build_parts(job)
    dist = Dist()
    learner = Learner(parts.policy, job.spec.trainer, dist)
    supervisors = [Supervisor(job, dist, lambda message: None)]
    supervisor = supervisors[0]
    supervisor.guard.counters = Counters(skipped=2, rollbacks=1)  # kept in checkpoints
    out = tmp_path / "out"
    out.mkdir()
    runs: list[Checkpointing] = []

    def next_run() -> Checkpointing:
        """The next run: its own supervisor (telemetry, /status), the same models."""
        if runs:
            runs[-1].close()
            supervisors.append(Supervisor(job, dist, lambda message: None))
        model = learner.engine_model
        runs.append(Checkpointing(job, out, dist, model, parts.tokenizer, supervisors[-1]))
        return runs[-1]

    checkpoints = next_run()
    cursor = Cursor(job.spec.trainer.seed)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    policy = learner.models.policy
    try:
        for step, healthy in SAVED.items():
            with torch.no_grad():
                for parameter in policy.parameters():
                    parameter.add_(0.01)
            weights[step] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            cursor.step = cursor.policy_version = step
            monkeypatch.setattr(supervisor, "healthy", lambda healthy=healthy: healthy)
            checkpoints.end_of_step(cursor, learner)
            checkpoints.checkpointer.wait()
        assert checkpoints.checkpointer.catalog.scan().committed == SAVED
        yield checkpoints, learner, cursor, weights, next_run
    finally:
        runs[-1].close()
        for each in supervisors:
            each.close()


def _damage(checkpoints: Checkpointing, step: int) -> None:
    corrupt(checkpoints.checkpointer.storage, f"step-{step:06d}/__0_0.distcp")


def _state(learner: Learner) -> dict[str, torch.Tensor]:
    return learner.models.policy.state_dict()


def test_a_damaged_healthy_target_is_skipped_for_an_older_healthy_one(saved_run) -> None:
    checkpoints, learner, cursor, weights, _ = saved_run
    _damage(checkpoints, 30)
    # Before: step 30 named, then the fallback below it took step 20, the unhealthy one.
    assert checkpoints.rollback(35, cursor, learner, replay_data=False) == 10
    assert all(torch.equal(v, weights[10][k]) for k, v in _state(learner).items())
    assert not any(torch.equal(v, weights[20][k]) for k, v in _state(learner).items())


def test_a_rollback_with_every_healthy_one_damaged_names_them(saved_run) -> None:
    checkpoints, learner, cursor, weights, _ = saved_run
    _damage(checkpoints, 30)
    _damage(checkpoints, 10)
    with pytest.raises(NoCheckpointError) as raised:
        checkpoints.rollback(35, cursor, learner, replay_data=False)
    message = str(raised.value)
    assert "no intact healthy checkpoint to roll back to before step 35" in message
    assert "step-000030: __0_0.distcp: checksum mismatch" in message
    assert "step-000010: __0_0.distcp: checksum mismatch" in message
    assert "step-000020" not in message  # the unhealthy one was never a candidate
    # Nothing was loaded: the live weights are still step 30's.
    assert all(torch.equal(v, weights[30][k]) for k, v in _state(learner).items())


def _train(learner: Learner, by: float) -> None:
    """Weights of the run's own, after its resume or rollback."""
    with torch.no_grad():
        for parameter in learner.models.policy.parameters():
            parameter.add_(by)


def _holds(learner: Learner, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in _state(learner).items())


def test_a_rollback_after_resume_n_stays_on_the_resumed_timeline(saved_run) -> None:
    _, learner, _, weights, next_run = saved_run
    # The user went back to step 10 (`--resume 10`): 20 and 30 are still in the folder
    # (retention deletes them at this run's first commit), but they are another past.
    checkpoints = next_run()
    cursor = checkpoints.resume(10, learner)
    assert cursor is not None and cursor.step == 10
    cursor.step = 15
    # Before: step 30 of the abandoned timeline was restored.
    assert checkpoints.rollback(35, cursor, learner, replay_data=False) == 10
    assert _holds(learner, weights[10])


def test_a_second_rollback_does_not_restore_what_the_first_abandoned(saved_run) -> None:
    checkpoints, learner, cursor, weights, _ = saved_run
    assert checkpoints.rollback(25, cursor, learner, replay_data=False) == 10
    # The run goes on from 10; a collapse at 35, before its next checkpoint: step 30
    # descends from the weights the first rollback escaped.
    _train(learner, 1.0)
    cursor.step = 35
    assert checkpoints.rollback(35, cursor, learner, replay_data=False) == 10
    assert _holds(learner, weights[10])


def test_a_rollback_takes_what_the_run_committed_after_its_resume(saved_run) -> None:
    _, learner, _, _, next_run = saved_run
    checkpoints = next_run()
    cursor = checkpoints.resume(10, learner)
    _train(learner, 0.5)
    later = {k: v.detach().clone() for k, v in _state(learner).items()}
    cursor.step = cursor.policy_version = 20
    checkpoints.end_of_step(cursor, learner)  # this run's own step 20, healthy
    checkpoints.checkpointer.wait()
    cursor.step = 25
    assert checkpoints.rollback(25, cursor, learner, replay_data=False) == 20
    assert _holds(learner, later)


def test_a_resume_names_its_checkpoint_and_counters_in_status(saved_run) -> None:
    """/status after a resume: the restored checkpoint and the guard's counters (it said
    none and 0 until the run's first commit and decision)."""
    _, learner, _, _, next_run = saved_run
    checkpoints = next_run()
    checkpoints.resume("auto", learner)
    status = checkpoints.supervisor.telemetry.board.snapshot()
    assert status["lastCheckpoint"]["step"] == 30
    assert status["lastCheckpoint"]["uri"].endswith("/ckpts/step-000030")
    assert status["lastHealthyCheckpoint"]["step"] == 30
    metrics = checkpoints.supervisor.telemetry.exporter.exposition().decode()
    assert "\nrlft_checkpoint_last_step 30.0\n" in metrics  # it said 0
    assert (status["rollbacks"], status["skippedUpdates"]) == (1, 2)


def test_a_restart_never_falls_back_to_the_timeline_a_resume_n_left(saved_run) -> None:
    """`--resume 10`, then a commit at 40: 20 and 30 are below the pointer but not 40's
    past (its manifest names 10 as its parent). Retention deletes them, and with 40
    damaged a restart resumes 10, not the 30 the user left."""
    _, learner, _, weights, next_run = saved_run
    checkpoints = next_run()
    cursor = checkpoints.resume(10, learner)
    _train(learner, 0.5)
    cursor.step = cursor.policy_version = 40
    checkpoints.end_of_step(cursor, learner)
    checkpoints.checkpointer.wait()
    scan = checkpoints.checkpointer.catalog.scan()
    assert scan.parents == {10: FRESH_START, 40: 10}  # before: 20 and 30 kept, 10 deleted
    _damage(checkpoints, 40)
    restarted = next_run()
    cursor = restarted.resume("auto", learner)
    assert cursor is not None and cursor.step == 10
    assert _holds(learner, weights[10])


def test_a_restart_after_a_rollback_resumes_the_restored_checkpoint(saved_run) -> None:
    """A crash between a rollback and the run's next commit: `latest` already names the
    restored step, so the restart does not resume the collapse it escaped."""
    checkpoints, learner, cursor, weights, next_run = saved_run
    cursor.step = 35
    assert checkpoints.rollback(25, cursor, learner, replay_data=False) == 10
    _train(learner, 1.0)
    restarted = next_run()  # no commit since the rollback
    cursor = restarted.resume("latest-healthy", learner)
    assert cursor is not None and cursor.step == 10  # before: 30
    assert _holds(learner, weights[10])


def test_a_checkpoint_whose_pointer_failed_stays_the_next_ones_parent(
    saved_run_behind_a_proxy,
) -> None:
    """Step 40's manifest is written but moving `latest` to it fails (the store answers
    403 AccessDenied): it is committed (a resume finds it), so step 50 descends from it
    and retention keeps it. Were 50's parent still 30, 40 would be deleted as another
    timeline's."""
    proxy, (checkpoints, learner, cursor, _, _) = saved_run_behind_a_proxy
    proxy.deny("/ckpts/latest", methods={"PUT"})
    cursor.step = cursor.policy_version = 40
    checkpoints.end_of_step(cursor, learner)
    checkpoints.checkpointer.wait()
    assert checkpoints.stats.failed == 1
    assert proxy.denied >= 1
    proxy.release()
    cursor.step = cursor.policy_version = 50
    checkpoints.end_of_step(cursor, learner)
    checkpoints.checkpointer.wait()
    scan = checkpoints.checkpointer.catalog.scan()
    assert scan.latest == 50 and scan.parents[50] == 40  # before: 30, and 40 deleted
    assert set(scan.manifests) == {30, 40, 50}  # keepLast 3


def test_a_rollback_skips_what_a_failed_retention_left_of_another_timeline(
    saved_run_behind_a_proxy,
) -> None:
    """`--resume 10` commits 40, whose retention fails (the store refuses deletions, as
    a key without s3:DeleteObject would): 20 and 30 stay. A restart resumes 40; a
    collapse before 40 must go back to 10, 40's past, not to the healthy 30."""
    proxy, (_, learner, _, weights, next_run) = saved_run_behind_a_proxy
    checkpoints = next_run()
    cursor = checkpoints.resume(10, learner)
    proxy.deny("?delete", methods={"POST"})  # S3 DeleteObjects: POST /bucket?delete
    cursor.step = cursor.policy_version = 40
    checkpoints.end_of_step(cursor, learner)
    checkpoints.checkpointer.wait()
    assert proxy.denied >= 1  # retention tried, and failed
    proxy.release()
    assert set(checkpoints.checkpointer.catalog.scan().manifests) == {10, 20, 30, 40}
    restarted = next_run()
    cursor = restarted.resume("auto", learner)
    assert cursor is not None and cursor.step == 40
    cursor.step = 43
    assert restarted.rollback(40, cursor, learner, replay_data=False) == 10  # before: 30
    assert _holds(learner, weights[10])
