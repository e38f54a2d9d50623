"""Which failure decides, when one reconcile sees several: the gravest first, rank 0's own
end of the run over a peer's teardown, a rollout pod's error never taken for a trainer
gang waiting for capacity; and an edit the operator rejects never fails a finished or
suspended job. Pure: `reconcile` and `invalid_spec` over plain data."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from jobs import job_doc, parsed
from pods import view

from rlft.operator.decision import Observed, invalid_spec
from rlft.operator.reconcile import reconcile
from rlft.operator.responses import PEER_VERDICT_WAIT_SECONDS
from rlft.operator.status import FailureRecord, rfc3339
from rlft.operator.status import RLFineTuneStatus as Status
from rlft.trainer.termination import Verdict

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CHILDREN = frozenset({"tiny-grpo-config", "tiny-grpo-trainer", "tiny-grpo-rollout"})
GANG = ["tiny-grpo-trainer-0/a", "tiny-grpo-trainer-1/b"]


def _reconcile(status: Status, pods: list, now: datetime = T0, **spec):
    two = {"trainer": {"replicas": {"min": 2, "max": 2}}, "restartPolicy": {"maxRestarts": 3}}
    job, body = parsed(job_doc(**{**two, **spec}))
    observed = Observed(pods=pods, config_maps=CHILDREN, services=CHILDREN)
    return reconcile(job, body, status, observed, now)


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


LOST = "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"
ENDED = "2026-01-01T00:00:00Z"  # T0


def test_a_peers_lost_rendezvous_waits_for_the_rank_whose_verdict_caused_it():
    """rank 0 exits 2 (a data file not there) and its agent closes the rendezvous; the
    kubelet reports trainer-1's agent, ended by that, first. Judged alone, its lost
    rendezvous restarted the gang, counted, and a job that cannot run restarted; the CI
    of `32fcc80` saw it twice in a row on the test cluster."""
    status = Status(phase="Running", gang_pods=GANG, gang_replicas="2:2")
    lost = _trainer(1, "b", phase="Failed", exit_code=1, message=LOST, finished_at=ENDED)
    running = _trainer(0, "a", phase="Running", pod_ip="10.0.0.1")
    d = _reconcile(status, [running, lost], now=T0 + timedelta(seconds=2))
    assert d.delete_pods == [] and d.status.restarts == 0, d.status.message
    assert d.status.phase == "Running" and "waiting for tiny-grpo-trainer-0" in d.status.message
    assert d.requeue_after is not None and d.requeue_after <= 13.0
    assert not any(e.reason == "Restarting" for e in d.events)
    bad = Verdict(2, "/data/not-there.jsonl: cannot read", rank=0)
    verdict = _trainer(0, "a", phase="Failed", exit_code=1, verdict=bad, finished_at=ENDED)
    d = _reconcile(d.status, [verdict, lost], now=T0 + timedelta(seconds=4))
    assert d.status.phase == "Failed" and d.status.restarts == 0
    assert d.status.last_failure.reason == "InvalidConfig"
    assert d.status.last_failure.pod == "tiny-grpo-trainer-0"


def test_a_peer_killed_mid_start_waits_for_the_rank_whose_verdict_caused_it():
    """As above, but trainer-1's worker was still starting when its agent ended it: no
    verdict and no rendezvous text, a plain error (the CI of 955b330 restarted once)."""
    status = Status(phase="Running", gang_pods=GANG, gang_replicas="2:2")
    killed = _trainer(1, "b", phase="Failed", exit_code=1, message="", finished_at=ENDED)
    running = _trainer(0, "a", phase="Running", pod_ip="10.0.0.1")
    d = _reconcile(status, [running, killed], now=T0 + timedelta(seconds=1))
    assert d.delete_pods == [] and d.status.restarts == 0, d.status.message
    bad = Verdict(2, "/data/not-there.jsonl: cannot read", rank=0)
    verdict = _trainer(0, "a", phase="Failed", exit_code=1, verdict=bad, finished_at=ENDED)
    d = _reconcile(d.status, [verdict, killed], now=T0 + timedelta(seconds=3))
    assert d.status.phase == "Failed" and d.status.restarts == 0
    assert d.status.last_failure.reason == "InvalidConfig"


def test_an_oom_kill_restarts_the_gang_without_waiting():
    status = Status(phase="Running", gang_pods=GANG, gang_replicas="2:2")
    oom = _trainer(
        1, "b", phase="Failed", exit_code=137, terminated_reason="OOMKilled", finished_at=ENDED
    )
    running = _trainer(0, "a", phase="Running", pod_ip="10.0.0.1")
    d = _reconcile(status, [running, oom], now=T0 + timedelta(seconds=1))
    assert d.status.restarts == 1 and d.status.last_failure.reason == "OOMKilled"


def test_a_lost_rendezvous_restarts_the_gang_once_its_peers_had_time_to_end():
    status = Status(phase="Running", gang_pods=GANG, gang_replicas="2:2")
    lost = _trainer(1, "b", phase="Failed", exit_code=1, message=LOST, finished_at=ENDED)
    running = _trainer(0, "a", phase="Running", pod_ip="10.0.0.1")
    d = _reconcile(status, [running, lost], now=T0 + timedelta(seconds=16))
    assert d.status.restarts == 1 and d.status.gang_attempt == 1
    assert sorted(d.delete_pods) == ["tiny-grpo-trainer-0", "tiny-grpo-trainer-1"]
    # Exactly PEER_VERDICT_WAIT_SECONDS after its end, the wait is over: judged now.
    d = _reconcile(status, [running, lost], now=T0 + timedelta(seconds=PEER_VERDICT_WAIT_SECONDS))
    assert d.status.restarts == 1 and d.status.gang_attempt == 1
    # A node clock an hour ahead: its end time is not trusted, the gang restarts now.
    ahead = _trainer(
        1, "b", phase="Failed", exit_code=1, message=LOST, finished_at="2026-01-01T01:00:00Z"
    )
    d = _reconcile(status, [running, ahead])
    assert d.status.restarts == 1 and d.status.gang_attempt == 1


def test_a_node_clock_a_few_seconds_ahead_still_waits_for_the_peers_verdict():
    """Node clocks drift: an end time a few seconds in the operator's future is trusted
    (up to PEER_VERDICT_WAIT_SECONDS ahead), and the lost rendezvous still waits."""
    status = Status(phase="Running", gang_pods=GANG, gang_replicas="2:2")
    ahead = "2026-01-01T00:00:10Z"  # T0 + 10 s
    lost = _trainer(1, "b", phase="Failed", exit_code=1, message=LOST, finished_at=ahead)
    running = _trainer(0, "a", phase="Running", pod_ip="10.0.0.1")
    d = _reconcile(status, [running, lost])
    assert d.delete_pods == [] and d.status.restarts == 0, d.status.message
    assert d.requeue_after is not None and d.requeue_after > PEER_VERDICT_WAIT_SECONDS


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


def test_an_edit_the_operator_rejects_before_it_saw_the_suspend_keeps_the_job():
    """Suspended, then edited before the operator moved the phase: the phase alone said
    Running, and the job failed for good instead of staying suspended."""
    pod = _trainer(0, "n0", phase="Running")
    d = invalid_spec(Status(phase="Running", step=120), PROBLEM, T0, [pod], suspend=True)
    assert d.status.phase == "Suspended" and "before resuming" in d.status.message
    assert d.status.last_failure is None and d.delete_pods == [pod.name]


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


def test_the_scheduling_timeout_counts_from_the_end_of_the_restart_backoff():
    """The 7th restart backs off 640 s, past schedulingTimeoutSeconds (600): counted from
    the gang's restart, its pods were declared unschedulable as soon as they were made."""
    restarted = Status(
        phase="Restarting",
        gang_attempt=7,
        gang_replicas="2:2",
        restarts=7,
        waiting_since="2026-01-01T00:00:00Z",
        next_restart_at="2026-01-01T00:10:40Z",
    )
    job, body = parsed(job_doc(trainer={"replicas": {"min": 2, "max": 2}}))
    made = reconcile(job, body, restarted, Observed(config_maps=CHILDREN, services=CHILDREN),
                     T0 + timedelta(seconds=641))  # fmt: skip
    assert [p["metadata"]["name"] for p in made.create if p["kind"] == "Pod"]
    pending = [_trainer(i, f"n{i}", phase="Pending") for i in range(2)]
    observed = Observed(pods=pending, config_maps=CHILDREN, services=CHILDREN)
    d = reconcile(job, body, made.status, observed, T0 + timedelta(seconds=642))
    (scheduled,) = [c for c in d.status.conditions if c.type == "Scheduled"]
    assert scheduled.status != "False", scheduled
    assert not any(e.reason == "Unschedulable" for e in d.events)
    later = reconcile(job, body, d.status, observed, T0 + timedelta(seconds=641 + 601))
    (scheduled,) = [c for c in later.status.conditions if c.type == "Scheduled"]
    assert scheduled.status == "False" and scheduled.reason == "Unschedulable"


def test_a_replicas_change_waits_with_an_edit_that_waits_for_a_suspend():
    """replicas 2:2 → 2:3 together with a learning rate (which waits for a suspend): the
    gang was restarted for the new shape, its pods were made from the running job file
    (2:2) and the status recorded 2:3, so the change was never made."""
    from rlft.operator import manifests as M

    old, old_body = parsed(job_doc(trainer={"replicas": {"min": 2, "max": 2}}))
    running_file = M.config_map(old, old_body)["data"]["job.yaml"]
    job, body = parsed(job_doc(trainer={"replicas": {"min": 2, "max": 3}, "learningRate": 0.001}))
    body["metadata"]["generation"] = 3
    status = Status(phase="Running", gang_pods=GANG, gang_replicas="2:2", observed_generation=1)
    pods = [_trainer(i, "ab"[i], phase="Running", pod_ip=f"10.0.0.{i}") for i in range(2)]
    observed = Observed(
        pods=pods,
        config_maps=CHILDREN,
        services=CHILDREN,
        config_data={"tiny-grpo-config": running_file},
    )
    d = reconcile(job, body, status, observed, T0)
    assert d.delete_pods == [] and d.status.gang_attempt == 0
    assert d.status.gang_replicas == "2:2" and "SuspendToApply" in [e.reason for e in d.events]
    # with no pod left running the whole edit applies, the new shape with it
    restarted = d.status.model_copy(update={"phase": "Restarting", "gang_pods": []})
    gone = Observed(config_maps=CHILDREN, services=CHILDREN, config_data=observed.config_data)
    later = reconcile(job, body, restarted, gone, T0 + timedelta(seconds=90))
    made = [p for p in later.create if p["kind"] == "Pod" and "trainer" in p["metadata"]["name"]]
    assert len(made) == 3
    assert all("--nnodes=2:3" in p["spec"]["containers"][0]["command"] for p in made)
    assert later.status.gang_replicas == "2:3"
    # ...but while a pod still runs (the rollout), replacements are the running file's
    rollout = _rollout(phase="Running", pod_ip="10.0.0.3")
    busy = Observed(
        pods=[rollout], config_maps=CHILDREN, services=CHILDREN, config_data=observed.config_data
    )
    held = reconcile(job, body, restarted, busy, T0 + timedelta(seconds=90))
    made = [p for p in held.create if p["kind"] == "Pod" and "trainer" in p["metadata"]["name"]]
    assert len(made) == 2
    assert all("--nnodes=2:2" in p["spec"]["containers"][0]["command"] for p in made)
    assert held.status.gang_replicas == "2:2"


def test_a_disruption_drops_restarts_older_than_the_window_from_the_history():
    """Not counted, a disruption still leaves `restartHistory` as the window holds it:
    restarts older than windowMinutes are forgotten, the recent ones kept."""
    old, recent = T0 - timedelta(minutes=30), T0 - timedelta(minutes=2)
    history = [rfc3339(old), rfc3339(recent)]
    status = Status(phase="Running", gang_pods=GANG, gang_replicas="2:2", restart_history=history)
    taken = dict(phase="Failed", exit_code=0, deleting=True, disruption="PreemptionByScheduler")
    pods = [_trainer(0, "a", **taken), _trainer(1, "b", phase="Running", pod_ip="10.0.0.2")]
    d = _reconcile(status, pods, restartPolicy={"maxRestarts": 3, "windowMinutes": 10})
    assert d.status.phase != "Failed" and d.status.last_failure.reason == "Preempted"
    assert "not counted" in d.status.last_failure.action
    assert d.status.restart_history == [history[1]]


def test_a_later_failure_never_shortens_a_restart_backoff_already_set():
    """A rollout pod's error while an earlier restart still waits out a longer backoff:
    the restart waits for the later of the two times, not the shorter new delay."""
    held = T0 + timedelta(seconds=300)
    status = Status(
        phase="Running", gang_pods=GANG, gang_replicas="2:2", next_restart_at=rfc3339(held)
    )
    pods = [
        _trainer(0, "a", phase="Running", pod_ip="10.0.0.1"),
        _trainer(1, "b", phase="Running", pod_ip="10.0.0.2"),
        _rollout(phase="Failed", exit_code=1),
    ]
    d = _reconcile(status, pods, restartPolicy={"maxRestarts": 3, "backoffSeconds": 10})
    assert d.status.last_failure.pod == "tiny-grpo-rollout-0" and d.status.restarts == 1
    assert d.status.next_restart_at == rfc3339(held)


def test_a_gang_short_of_a_node_restarts_its_rendezvous_without_waiting_for_verdicts():
    """trainer-2 has no node yet, so the gang could never meet: trainer-1's lost
    rendezvous is no peer's consequence, and the wait for verdicts would only delay the
    uncounted restart of the rendezvous."""
    gang = [*GANG, "tiny-grpo-trainer-2/c"]
    status = Status(phase="Running", gang_pods=gang, gang_replicas="3:3")
    lost = _trainer(1, "b", phase="Failed", exit_code=1, message=LOST, finished_at=ENDED)
    running = _trainer(0, "a", phase="Running", pod_ip="10.0.0.1")
    pending = _trainer(2, "c", phase="Pending")
    d = _reconcile(
        status,
        [running, lost, pending],
        now=T0 + timedelta(seconds=2),
        trainer={"replicas": {"min": 3, "max": 3}},
    )
    assert d.status.gang_attempt == 1 and d.status.restarts == 0, d.status.message
    assert "tiny-grpo-trainer-0" in d.delete_pods and "tiny-grpo-trainer-1" in d.delete_pods


def test_a_lost_rendezvous_waits_for_no_rank_the_operator_already_restarted():
    """trainer-0 belongs to a gang the operator restarted (handled; its delete not landed
    yet): it still runs, but it is no peer whose verdict could be the cause. trainer-1's
    lost rendezvous is judged at once."""
    status = Status(
        phase="Running",
        gang_pods=["tiny-grpo-trainer-1/b"],
        gang_replicas="2:2",
        handled_pods=["a"],
    )
    lost = _trainer(1, "b", phase="Failed", exit_code=1, message=LOST, finished_at=ENDED)
    stale = _trainer(0, "a", phase="Running", pod_ip="10.0.0.1")
    d = _reconcile(status, [stale, lost], now=T0 + timedelta(seconds=2))
    assert d.status.last_failure is not None and d.status.last_failure.pod == "tiny-grpo-trainer-1"
    assert d.status.restarts == 1 and "tiny-grpo-trainer-1" in d.delete_pods
