"""The failure policy: every failure kind is recognised from a real pod status, and the
restart budget and backoff do what the docs say."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pods import raw_pod, view

from rlft.operator import failures as P
from rlft.operator.observe import pod_view, trainer_report
from rlft.trainer import termination

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)

CASES = [
    # (pod arguments, kind, permanent, group)
    (dict(phase="Failed", exit_code=137, terminated_reason="OOMKilled"), P.OOM, False, False),
    (dict(phase="Failed", pod_reason="Evicted"), P.EVICTED, False, False),
    (
        dict(phase="Failed", exit_code=143, disruption="PreemptionByScheduler"),
        P.PREEMPTED,
        False,
        False,
    ),
    (dict(phase="Failed", pod_reason="Preempting"), P.PREEMPTED, False, False),
    (dict(phase="Unknown"), P.NODE_LOST, False, False),
    (dict(phase="Failed", pod_reason="NodeLost"), P.NODE_LOST, False, False),
    (
        dict(phase="Failed", exit_code=137, disruption="DeletionByTaintManager"),
        P.NODE_LOST,
        False,
        False,
    ),
    (
        dict(
            phase="Failed",
            exit_code=1,
            message="torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError",
        ),
        P.RENDEZVOUS,
        False,
        True,
    ),
    (
        dict(
            phase="Failed",
            exit_code=1,
            message="[Rank 3] Watchdog caught collective operation "
            "timeout: WorkNCCL(SeqNum=88, OpType=ALLREDUCE)",
        ),
        P.RENDEZVOUS,
        False,
        True,
    ),
    (
        dict(phase="Failed", exit_code=1, message="Traceback ... KeyError: 'x'"),
        P.ERROR,
        False,
        False,
    ),
    (dict(phase="Failed", exit_code=139), P.ERROR, False, False),
    (
        dict(phase="Failed", exit_code=2, message="job.yaml: spec.x: unknown field"),
        P.INVALID_CONFIG,
        True,
        False,
    ),
    (dict(phase="Failed", exit_code=3), P.COLLAPSED, False, False),
    # The kubelet's admission refused the pod (a device plugin restarted): it never ran.
    (
        dict(
            phase="Failed",
            pod_reason="UnexpectedAdmissionError",
            pod_message="Allocate failed due to no healthy devices present",
        ),
        P.REJECTED,
        False,
        False,
    ),
    # A liveness kill: the kubelet reports only exit code 137 (or 143) and reason Error;
    # the rank's own verdict, written as it stopped answering 200, says it stalled.
    (
        dict(
            phase="Failed",
            exit_code=137,
            verdict=termination.Verdict(1, "stalled: rank 1 made no progress", 1, stalled=True),
        ),
        P.STALLED,
        False,
        True,
    ),
]


@pytest.mark.parametrize(("kwargs", "kind", "permanent", "group"), CASES)
def test_classify(kwargs, kind, permanent, group):
    failure = P.classify(view("tiny-grpo-trainer-0", **kwargs))
    assert failure is not None and failure.kind == kind
    assert failure.permanent == permanent and failure.group == group


@pytest.mark.parametrize(("kwargs", "kind"), [(case[0], case[1]) for case in CASES])
def test_only_the_clusters_disruptions_are_flagged(kwargs, kind):
    """Preemption and a lost node are the cluster's doing (not counted against
    restartPolicy by default); the kubelet's eviction for node pressure and every failure
    of the pod's own are not."""
    failure = P.classify(view("tiny-grpo-trainer-0", **kwargs))
    assert failure is not None
    assert failure.disruption == (kind in (P.PREEMPTED, P.NODE_LOST))


def test_a_pod_the_kubelet_refused_says_why():
    """It read as the job's own Error, with no message: the kubelet's is kept. Counted
    still: a node that keeps refusing it would have it recreated forever."""
    refused = view(
        "tiny-grpo-trainer-0",
        phase="Failed",
        pod_reason="OutOfnvidia.com/gpu",
        pod_message="Node didn't have enough resource: nvidia.com/gpu",
    )
    failure = P.classify(refused)
    assert failure is not None and failure.kind == P.REJECTED and not failure.disruption
    said = "OutOfnvidia.com/gpu: Node didn't have enough resource: nvidia.com/gpu"
    assert failure.message == said


def test_a_pod_on_a_lost_node_is_a_disruption_though_its_status_says_running():
    """The taint manager deleted it from a node that stopped reporting: its status is
    stale (still Running), and its loss is the cluster's doing."""
    pod = view(
        "tiny-grpo-trainer-0",
        phase="Running",
        disruption="DeletionByTaintManager",
        deleting=True,
        ready=False,
    )
    assert pod.on_lost_node
    failure = P.classify(pod)
    assert failure is not None and failure.kind == P.NODE_LOST and failure.disruption


def test_covers_every_kind():
    seen = {kind for _, kind, _, _ in CASES} | {P.IMAGE_PULL, P.CONFIG_ERROR}
    assert seen == set(P.KINDS)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(phase="Running"),
        dict(phase="Succeeded", exit_code=0),
        dict(phase="Running", disruption="PreemptionByScheduler"),
    ],
)
def test_no_failure(kwargs):
    assert P.classify(view("tiny-grpo-trainer-0", **kwargs)) is None


def test_a_rank_stopped_after_its_emergency_checkpoint_is_no_failure_whatever_torchrun_exits():
    """A stopped rank of a multi-pod gang exits non-zero so that its torchrun agent does
    not wait in its exit barrier for a peer that was SIGTERMed: the agent then exits 1,
    the pod is Failed, and the verdict (exit code 0, stopped) is what decides."""
    stopped = termination.Verdict(0, rank=1, stopped=True, step=6, last_checkpoint=6)
    pod = view("tiny-grpo-trainer-1", phase="Failed", exit_code=1, verdict=stopped)
    assert P.classify(pod) is None
    unstopped = termination.Verdict(0, rank=1)
    pod = view("tiny-grpo-trainer-1", phase="Failed", exit_code=1, verdict=unstopped)
    assert P.classify(pod).kind == P.ERROR  # exit 0 of a worker, yet the agent failed


def test_a_rollout_server_that_exits_is_a_failure():
    failure = P.classify(view("tiny-grpo-rollout-0", "rollout", phase="Succeeded", exit_code=0))
    assert failure is not None and failure.kind == P.ERROR and not failure.group
    assert not failure.disruption
    failure = P.classify(view("tiny-grpo-rollout-0", "rollout", phase="Succeeded"))
    assert failure is not None and failure.kind == P.ERROR


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(phase="Failed", exit_code=3),
        dict(
            phase="Failed",
            exit_code=137,
            verdict=termination.Verdict(1, "stalled: no progress", 0, stalled=True),
        ),
    ],
)
def test_a_collapse_or_a_stall_is_a_trainers_verdict_only(kwargs):
    """Exit code 3 and a stalled verdict are the trainer's words (its stability guard, its
    progress watchdog): a rollout pod ending so is a plain error, restarted on its own,
    never the job failed or the trainer gang restarted."""
    failure = P.classify(view("tiny-grpo-rollout-0", "rollout", **kwargs))
    assert failure is not None and failure.kind == P.ERROR
    assert not failure.group and not failure.permanent


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        (dict(disruption="EvictionByEvictionAPI", deleting=True), P.EVICTED),
        (dict(disruption="PreemptionByScheduler", deleting=True), P.PREEMPTED),
        (dict(disruption="TerminationTarget/Preempted", deleting=True), P.PREEMPTED),
        (dict(pod_reason="Terminated"), P.NODE_LOST),
    ],
)
def test_a_rollout_server_the_cluster_took_is_a_disruption_though_it_exited_0(kwargs, kind):
    """`rlft rollout` exits 0 on its SIGTERM: a drained or preempted rollout pod ends
    Succeeded. It was counted as an Error against restartPolicy (a drain over a few
    instances used up maxRestarts), though disruptions are not counted."""
    pod = view("tiny-grpo-rollout-0", "rollout", phase="Succeeded", exit_code=0, **kwargs)
    failure = P.classify(pod)
    assert failure is not None and failure.kind == kind and failure.disruption


@pytest.mark.parametrize(
    ("waiting", "kind", "permanent"),
    [
        ("ErrImagePull", P.IMAGE_PULL, False),
        ("ImagePullBackOff", P.IMAGE_PULL, False),
        ("InvalidImageName", P.IMAGE_PULL, True),
        ("CreateContainerConfigError", P.CONFIG_ERROR, False),
    ],
)
def test_waiting_problems(waiting, kind, permanent):
    problem = P.waiting_problem(view("tiny-grpo-trainer-0", waiting=waiting))
    assert problem is not None and problem.kind == kind and problem.permanent == permanent
    assert P.classify(view("tiny-grpo-trainer-0", waiting=waiting)) is None


def test_pod_view_ignores_foreign_pods():
    pod = raw_pod("someone-else")
    pod["metadata"]["labels"] = {"app": "web"}
    assert pod_view(pod) is None


def test_backoff_doubles_and_is_capped():
    assert [P.backoff_seconds(10, n) for n in range(1, 5)] == [10, 20, 40, 80]
    assert P.backoff_seconds(10, 40) == P.MAX_BACKOFF_SECONDS
    assert P.backoff_seconds(0, 3) == 0
    assert P.backoff_seconds(10, 0) == 0  # no restart in the window yet: no delay


@pytest.mark.parametrize("runs_for_s", [0, 30, 120])
def test_a_crash_loop_under_the_default_policy_fails_the_job(runs_for_s: int) -> None:
    """maxRestarts 10 in 60 minutes, backoff from 10 s: the doubling waits alone passed
    the window before the 11th failure, so a job failing after every start was
    restarted for ever (2,000 times in two weeks) and never failed."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    history: list[datetime] = []
    failures = 0
    while failures < 200:
        failures += 1
        budget = P.ask_restart(history, now, max_restarts=10, window_minutes=60, backoff=10)
        if not budget.allowed:
            break
        history = budget.history
        now += timedelta(seconds=budget.delay + runs_for_s)  # restarted, fails again
    assert not budget.allowed and failures == 11, failures
    assert now - datetime(2026, 1, 1, tzinfo=UTC) < timedelta(minutes=60)


def test_restart_budget_is_per_window():
    history: list[datetime] = []
    for i in range(3):
        budget = P.ask_restart(
            history, NOW + timedelta(seconds=i), max_restarts=3, window_minutes=10, backoff=5
        )
        assert budget.allowed and budget.delay == 5 * 2**i
        history = budget.history
    assert not P.ask_restart(
        history, NOW + timedelta(minutes=1), max_restarts=3, window_minutes=10, backoff=5
    ).allowed
    # restarts older than the window no longer count
    later = P.ask_restart(
        history, NOW + timedelta(minutes=11), max_restarts=3, window_minutes=10, backoff=5
    )
    assert later.allowed and len(later.history) == 1 and later.delay == 5


def test_a_restart_exactly_window_minutes_old_no_longer_counts():
    """The window is the last windowMinutes, its start excluded."""
    first = P.ask_restart([], NOW, max_restarts=1, window_minutes=10, backoff=5)
    assert first.allowed
    edge = NOW + timedelta(minutes=10)
    assert P.in_window(first.history, edge, 10) == []
    assert P.ask_restart(first.history, edge, max_restarts=1, window_minutes=10, backoff=5).allowed
    just_inside = edge - timedelta(microseconds=1)
    assert P.in_window(first.history, just_inside, 10) == [NOW]
    budget = P.ask_restart(first.history, just_inside, max_restarts=1, window_minutes=10, backoff=5)
    assert not budget.allowed


@given(st.lists(st.integers(0, 3600), max_size=30), st.integers(0, 10), st.floats(0.1, 120))
def test_budget_never_exceeds_max_restarts(offsets, max_restarts, window):
    history: list[datetime] = []
    for offset in sorted(offsets):
        now = NOW + timedelta(seconds=offset)
        budget = P.ask_restart(
            history, now, max_restarts=max_restarts, window_minutes=window, backoff=1
        )
        if budget.allowed:
            history = budget.history
        assert len(P.in_window(history, now, window)) <= max_restarts


def test_trainer_report_parsing():
    doc = {
        "step": 120,
        "policyVersion": 120,
        "phase": "training",
        "health": "warning",
        "lastCheckpoint": {"step": 100, "uri": "s3://b/x/step-000100", "time": "t"},
        "lastHealthyCheckpoint": {"step": 100, "uri": "s3://b/x/step-000100", "time": "t"},
        "rollbacks": 1,
        "skippedUpdates": 2,
        "events": [{"kind": "spike"}],
        "reward": 0.5,
    }
    report = trainer_report(doc, "uid-1")
    assert report is not None and report.step == 120 and report.health == "warning"
    assert report.last_checkpoint == {"step": 100, "uri": "s3://b/x/step-000100", "time": "t"}
    assert report.reward == 0.5 and report.events == [{"kind": "spike"}]
    assert trainer_report("<html>502</html>", "uid-1") is None
    for unwritable in ("NaN", "Infinity", "-Infinity"):  # as Python's json reads them
        parsed = trainer_report(json.loads(f'{{"step": 3, "reward": {unwritable}}}'), "u")
        assert parsed is not None and parsed.reward is None
    assert trainer_report({"step": "x", "health": "??", "lastCheckpoint": {"uri": 1}}, "u") == (
        trainer_report({"step": None}, "u")
    )
