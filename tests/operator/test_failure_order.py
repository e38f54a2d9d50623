"""Which failure decides, when one reconcile sees several: the gravest first, rank 0's own
end of the run over a peer's teardown, a rollout pod's error never taken for a trainer
gang waiting for capacity; and an edit the operator rejects never fails a finished or
suspended job. Pure: `reconcile` and `invalid_spec` over plain data."""

from __future__ import annotations

from datetime import UTC, datetime

from jobs import job_doc, parsed
from pods import view

from rlft.operator.decision import Observed, invalid_spec
from rlft.operator.reconcile import reconcile
from rlft.operator.status import FailureRecord
from rlft.operator.status import RLFineTuneStatus as Status
from rlft.trainer.termination import Verdict

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CHILDREN = frozenset({"tiny-grpo-config", "tiny-grpo-trainer", "tiny-grpo-rollout"})
GANG = ["tiny-grpo-trainer-0/a", "tiny-grpo-trainer-1/b"]


def _reconcile(status: Status, pods: list, **spec):
    two = {"trainer": {"replicas": {"min": 2, "max": 2}}, "restartPolicy": {"maxRestarts": 3}}
    job, body = parsed(job_doc(**{**two, **spec}))
    observed = Observed(pods=pods, config_maps=CHILDREN, services=CHILDREN)
    return reconcile(job, body, status, observed, T0)


def _trainer(index: int, uid: str, **kwargs):
    return view(f"tiny-grpo-trainer-{index}", "trainer", index, uid=uid, **kwargs)


def _rollout(**kwargs):
    return view("tiny-grpo-rollout-0", "rollout", 0, uid="r", **kwargs)


def test_a_permanent_error_decides_though_a_peers_broken_connection_sorts_first():
    """trainer-1's ranks raise a ValueError (exit 2): trainer-0's collectives break (exit
    1). Judged in name order, trainer-0's restart marked trainer-1 handled, and the bad
    job was restarted until its budget ran out."""
    pods = [
        _trainer(0, "a", phase="Failed", exit_code=1, verdict=Verdict(1, "NCCL aborted", rank=0)),
        _trainer(1, "b", phase="Failed", exit_code=1, verdict=Verdict(2, "ValueError", rank=1)),
        _rollout(phase="Running", pod_ip="10.0.0.3"),
    ]
    d = _reconcile(Status(phase="Running", gang_pods=GANG, gang_replicas="2:2"), pods)
    assert d.status.phase == "Failed" and d.status.restarts == 0
    assert d.status.last_failure.pod == "tiny-grpo-trainer-1"
    assert d.status.last_failure.reason == "InvalidConfig"


def test_rank_0_finishing_is_not_undone_by_a_peer_failing_in_its_teardown():
    """rank 0 reported the run complete; trainer-1's agent exited 1 meanwhile. It was
    judged first: a finished job restarted, or failed when the budget was spent."""
    history = ["2025-12-31T23:40:00Z", "2025-12-31T23:45:00Z", "2025-12-31T23:50:00Z"]
    status = Status(
        phase="Running", gang_pods=GANG, gang_replicas="2:2", restart_history=history, step=149
    )
    done = Verdict(0, "", rank=0, completed=True, step=150, last_checkpoint=150)
    pods = [
        _trainer(0, "a", phase="Succeeded", exit_code=0, verdict=done),
        _trainer(1, "b", phase="Failed", exit_code=1),
    ]
    d = _reconcile(status, pods)
    assert d.status.phase == "Succeeded", (d.status.message, d.status.last_failure)
    assert d.status.restarts == 0 and d.status.gang_attempt == 0


def test_a_pause_after_a_collapse_is_not_undone_by_a_peer_failing_in_its_teardown():
    paused = Verdict(0, "collapse at step 40; paused", rank=0, collapsed=True)
    pods = [
        _trainer(0, "a", phase="Succeeded", exit_code=0, verdict=paused),
        _trainer(1, "b", phase="Failed", exit_code=1),
    ]
    d = _reconcile(Status(phase="Running", gang_pods=GANG, gang_replicas="2:2"), pods)
    assert d.set_suspend and d.status.restarts == 0 and d.status.gang_attempt == 0


def test_a_rollout_pods_rendezvous_like_error_costs_budget_while_trainers_wait():
    """A Ray head's NCCL watchdog timeout reads like a rendezvous timeout. While the
    trainer gang waited for nodes it took the trainers' path: the gang restarted, no
    restart counted, no backoff, and a crash-looping head restarted without limit."""
    multi = {"engine": "vllm", "nodesPerInstance": 2, "gpusPerInstance": 2}
    head = view(
        "tiny-grpo-rollout-0-head", "ray-head", 0, uid="h", phase="Failed", exit_code=1,
        message="RuntimeError: Watchdog caught collective operation timeout: WorkNCCL(...)",
    )  # fmt: skip
    worker = view(
        "tiny-grpo-rollout-0-worker-1", "ray-worker", 0, uid="w", phase="Running", pod_ip="x"
    )
    pending = [_trainer(i, f"t{i}", phase="Pending") for i in range(2)]
    status = Status(phase="Pending", gang_replicas="2:2", waiting_since="2025-12-31T23:59:00Z")
    d = _reconcile(status, [*pending, head, worker], rollout=multi)
    assert d.status.restarts == 1 and d.status.next_restart_at is not None
    assert d.status.gang_attempt == 0  # the trainers were not the ones failing
    assert sorted(d.delete_pods) == ["tiny-grpo-rollout-0-head", "tiny-grpo-rollout-0-worker-1"]


def test_a_gang_member_already_gone_counts_as_placed():
    """trainer-1 of a running gang was force-deleted; trainer-0 then fails with a broken
    connection. Counting only pods still seen, the gang looked unplaced: no restart
    counted, and an Event saying a pod was not scheduled yet."""
    broken = _trainer(
        0, "a", phase="Failed", exit_code=1,
        message="torch.distributed.DistNetworkError: Connection reset by peer",
    )  # fmt: skip
    pods = [broken, _rollout(phase="Running", pod_ip="10.0.0.3")]
    d = _reconcile(Status(phase="Running", gang_pods=GANG, gang_replicas="2:2"), pods)
    assert d.status.restarts == 1, [e.message for e in d.events]
    assert not any(e.reason == "Waiting" for e in d.events)


PROBLEM = ["spec.rollout.engine: vLLM on the CPU needs attention heads of at least 32"]


def test_an_edit_the_operator_rejects_keeps_a_suspended_job_suspended():
    """Suspend, edit, resume: an edit only the operator can reject failed the job for good
    (its checkpoints with it); it stays suspended, saying what to fix."""
    status = Status(phase="Suspended", step=120, resume="latest-healthy")
    d = invalid_spec(status, PROBLEM, T0, [])
    assert d.status.phase == "Suspended" and d.status.step == 120
    assert "spec.rollout.engine" in d.status.message and "before resuming" in d.status.message
    assert [e.reason for e in d.events] == ["InvalidSpec"]
    assert invalid_spec(d.status, PROBLEM, T0, []).events == []  # said once


def test_an_edit_the_operator_rejects_leaves_a_finished_job_as_it_was():
    done = Status(phase="Succeeded", message="training finished")
    assert invalid_spec(done, PROBLEM, T0, []).status == done
    failed = Status(
        phase="Failed",
        message="too many restarts",
        last_failure=FailureRecord(reason="TooManyRestarts", time="2026-01-01T00:00:00Z"),
    )
    d = invalid_spec(failed, PROBLEM, T0, [])
    assert d.status == failed and d.events == []
