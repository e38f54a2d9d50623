"""The state machine: every phase transition, every failure kind's response, and
properties over random sequences of pod events (hypothesis): no duplicate pods, never more
restarts than maxRestarts in the window, never a lost checkpoint reference."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jobs import job_doc, parsed
from pods import raw_pod, view

from rlft.operator import failures as P
from rlft.operator import names as N
from rlft.operator.decision import Decision, Observed
from rlft.operator.observe import PodView, TrainerReport, pod_view
from rlft.operator.reconcile import reconcile
from rlft.operator.responses import STUCK_TERMINATING_SECONDS
from rlft.operator.status import RLFineTuneStatus, parse_time
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.termination import Verdict

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RESTARTS = {"maxRestarts": 3, "windowMinutes": 60, "backoffSeconds": 10}


@dataclass
class World:
    """A job, its pods and the clock: applies decisions like an API server would."""

    spec: dict[str, Any] = field(default_factory=dict)
    status: RLFineTuneStatus = field(default_factory=RLFineTuneStatus)
    pods: dict[str, PodView] = field(default_factory=dict)
    other: set[str] = field(default_factory=set)  # ConfigMaps and Services
    config: dict[str, str] = field(default_factory=dict)  # each ConfigMap's job file
    now: datetime = T0
    report: TrainerReport | None = None
    events: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    oom_killed: list[PodView] = field(default_factory=list)
    serial: int = 0
    generation: int = 1
    """metadata.generation: `edit` bumps it, as the API server does on a spec change."""

    def edit(self, **spec: Any) -> None:
        self.spec.update(copy.deepcopy(spec))
        self.generation += 1

    def step(self) -> Decision:
        job, body = parsed(job_doc(**copy.deepcopy(self.spec)))
        body["metadata"]["generation"] = self.generation
        observed = Observed(
            pods=list(self.pods.values()),
            config_maps=frozenset(self.other),
            services=frozenset(self.other),
            report=self.report,
            config_data=dict(self.config),
            oom_killed=list(self.oom_killed),
        )
        d = reconcile(job, body, self.status, observed, self.now)
        self.check(d)
        self.status = d.status
        for name in d.delete_pods:
            self.pods.pop(name)
        for name in d.force_delete_pods:
            self.pods.pop(name)
        for manifest in d.create:
            name = manifest["metadata"]["name"]
            if manifest["kind"] == "Pod":
                labels = manifest["metadata"]["labels"]
                self.serial += 1
                self.pods[name] = view(
                    name,
                    labels["rlft.dev/role"],
                    int(labels["rlft.dev/index"]),
                    uid=f"u{self.serial}",
                    created=self.now.isoformat(),
                )
                self.created.append(name)
            else:
                self.other.add(name)
                if manifest["kind"] == "ConfigMap":
                    self.config[name] = manifest["data"]["job.yaml"]
        for manifest in d.update:
            self.config[manifest["metadata"]["name"]] = manifest["data"]["job.yaml"]
        if d.set_suspend:
            self.spec["suspend"] = True
        self.events += [e.reason for e in d.events]
        return d

    def check(self, d: Decision) -> None:
        names = [m["metadata"]["name"] for m in d.create]
        assert len(names) == len(set(names)), "one name created twice"
        for manifest in d.create:
            assert manifest["metadata"]["name"] not in self.pods, "a pod created over another"
        for name in d.delete_pods:
            assert name in self.pods
        for name in d.force_delete_pods:
            assert self.pods[name].deleting, "only a pod already being deleted is forced"
        st = d.status
        limit = RESTARTS["maxRestarts"]
        recent = P.in_window([parse_time(t) for t in st.restart_history], self.now, 60)
        assert len(recent) <= limit
        if st.phase in ("Failed", "Succeeded", "Suspended"):
            assert not any(m["kind"] == "Pod" for m in d.create)
        if self.status.last_checkpoint is not None:
            assert st.last_checkpoint is not None, "the checkpoint reference was lost"
        hold = parse_time(st.next_restart_at)
        if hold is not None and self.now < hold:
            assert not any(m["kind"] == "Pod" for m in d.create), "created during the backoff"

    def set(self, name: str, **kwargs: Any) -> None:
        pod = self.pods[name]
        self.pods[name] = view(
            name, pod.role, pod.index, uid=pod.uid, created=pod.created, **kwargs
        )

    def run_all(self) -> None:
        for name in list(self.pods):
            self.set(name, phase="Running", pod_ip="10.0.0.1")

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def _world(**spec: Any) -> World:
    return World(spec={"restartPolicy": dict(RESTARTS), **spec})


def _running_world() -> tuple[World, str]:
    """A job whose pods all run, and its trainer-0's uid (what its reports carry)."""
    w = _world()
    w.step()
    w.run_all()
    return w, w.pods["tiny-grpo-trainer-0"].uid


def test_first_reconcile_creates_every_child_and_waits():
    w = _world()
    d = w.step()
    kinds = sorted(m["kind"] for m in d.create)
    assert kinds == ["ConfigMap", "NetworkPolicy", "Pod", "Pod", "Secret", "Service", "Service"]
    assert w.status.phase == "Pending" and w.events == ["Creating"]
    assert "--resume=auto" in d.create[-2]["spec"]["containers"][0]["command"] or any(
        "--resume=auto" in m["spec"]["containers"][0]["command"]
        for m in d.create
        if m["kind"] == "Pod" and "trainer" in m["metadata"]["name"]
    )
    assert w.step().create == []  # idempotent


def _fail_and_restart(w: World, trainer: str, **kwargs: Any) -> list[str]:
    """Fail `trainer`, then step past the backoff: the restarted pod's command."""
    w.set(trainer, phase="Failed", exit_code=1, **kwargs)
    w.step()
    w.tick(600)
    for _ in range(4):
        again = [m for m in w.step().create if m["metadata"]["name"] == trainer]
        if again:
            return again[0]["spec"]["containers"][0]["command"]
        w.tick(60)
    raise AssertionError("the failed gang was not restarted")


@pytest.mark.parametrize("choice", ["auto", "latest-healthy", "never"])
def test_starts_take_the_jobs_resume_choice_until_it_has_a_checkpoint(choice):
    """`never` is about checkpoints at the location before the job: a restart before the
    job's first checkpoint (a warm start failing, say) takes the spec's choice again, so
    it never loads another run's checkpoint; once the job has one, every start resumes."""
    w = _world(checkpoint={"uri": "s3://bucket/run", "resume": choice})
    trainer = "tiny-grpo-trainer-0"
    d = w.step()
    first = next(m for m in d.create if m["metadata"]["name"] == trainer)
    assert first["spec"]["containers"][0]["command"][-1] == f"--resume={choice}"
    w.run_all()
    w.step()
    assert _fail_and_restart(w, trainer)[-1] == f"--resume={choice}"
    w.run_all()
    w.report = TrainerReport(pod_uid=w.pods[trainer].uid, step=4, last_checkpoint=_checkpoint(4))
    w.step()
    w.report = None
    assert _fail_and_restart(w, trainer)[-1] == "--resume=latest-healthy"
    assert w.status.resume == "latest-healthy"


def test_a_checkpoint_named_only_in_a_termination_message_counts_as_the_jobs_own():
    """A gang stopped by SIGTERM (a preemption, say) commits its emergency checkpoint and
    ends between two polls of /status: its ranks' termination messages name it, and the
    restart resumes it."""
    w = _world(checkpoint={"uri": "s3://bucket/run", "resume": "never"})
    trainer = "tiny-grpo-trainer-0"
    w.step()
    w.run_all()
    w.step()
    verdict = Verdict(ExitCode.OK, stopped=True, last_checkpoint=6)  # exit 1: see training.py
    command = _fail_and_restart(w, trainer, pod_reason="Preempting", verdict=verdict)
    assert command[-1] == "--resume=latest-healthy"


def test_pending_to_running_when_the_gang_runs():
    w = _world(trainer={"replicas": {"min": 2, "max": 3}})
    w.step()
    w.set("tiny-grpo-trainer-0", phase="Running")
    w.step()
    assert w.status.phase == "Pending" and "(1 of 2 running)" in w.status.message
    w.set("tiny-grpo-trainer-1", phase="Running")
    w.step()
    assert w.status.phase == "Running" and w.events[-1] == "Running"
    assert w.status.resume == "auto"  # no checkpoint of its own yet
    conditions = {c.type: c for c in w.status.conditions}
    assert conditions["Scheduled"].status == "True"
    assert conditions["Ready"].status == "False"  # trainer-2 and the rollout still pending
    w.run_all()
    w.step()
    assert {c.type: c.status for c in w.status.conditions}["Ready"] == "True"


def test_the_gang_is_unschedulable_when_the_requeue_it_asked_for_comes() -> None:
    """Waiting for placement asks to be looked at again when schedulingTimeoutSeconds is
    up: at that moment the gang has waited the whole timeout, and Scheduled turns False."""
    w = _world(scheduling={"schedulingTimeoutSeconds": 60})
    d = w.step()
    assert _condition(w, "Scheduled") == ("Unknown", "Waiting") and d.requeue_after == 60
    w.tick(60)
    w.step()
    assert _condition(w, "Scheduled") == ("False", "Unschedulable")


def test_a_rollout_pod_restarting_leaves_the_running_gang_running() -> None:
    """A rollout pod's restart backoff holds no trainer slot: the full gang trains on,
    and the job stays Running while the rollout pod waits to be recreated."""
    w = _world()
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-rollout-0", phase="Failed", exit_code=1)
    w.step()
    assert w.status.restarts == 1 and w.status.next_restart_at is not None
    assert w.status.phase == "Running", w.status.message
    w.tick(1)
    w.step()  # still within the backoff
    assert w.status.phase == "Running", w.status.message


def test_scheduling_timeout_sets_scheduled_false_once():
    w = _world(scheduling={"schedulingTimeoutSeconds": 60})
    w.step()
    w.tick(30)
    d = w.step()
    assert {c.type: c.status for c in w.status.conditions}["Scheduled"] == "Unknown"
    assert d.requeue_after == pytest.approx(30)
    w.tick(31)
    w.step()
    scheduled = {c.type: c for c in w.status.conditions}["Scheduled"]
    assert scheduled.status == "False" and scheduled.reason == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in scheduled.message
    assert w.status.phase == "Pending"  # waiting is not failing
    w.step()
    assert w.events.count("Unschedulable") == 1


def test_a_gang_placed_but_never_running_keeps_its_wait_counted() -> None:
    """schedulingTimeoutSeconds bounds the wait for a gang that never ran: its pods
    placed for a while (then unplaced again, a preemption before they started) do not
    start the clock anew."""
    w = _world(scheduling={"schedulingTimeoutSeconds": 60})
    w.step()
    w.tick(30)
    w.set("tiny-grpo-trainer-0", scheduled=True)
    w.step()
    assert _condition(w, "Scheduled") == ("True", "GangScheduled")
    assert w.status.phase == "Pending"
    w.tick(31)
    w.set("tiny-grpo-trainer-0")  # unplaced again
    w.step()
    assert _condition(w, "Scheduled") == ("False", "Unschedulable")


def test_a_timeout_before_the_schedulers_reason_looks_again_until_it_is_named():
    """The scheduler had not tried the pending pod when the timeout ran out (a loaded
    scheduler): the condition says Unschedulable at once and names the reason as soon
    as the pod carries it, with one Event."""
    w = _world(scheduling={"schedulingTimeoutSeconds": 5})
    w.step()
    tried = dict(w.pods)
    w.pods = {name: replace(pod, unschedulable="") for name, pod in tried.items()}
    w.tick(6)
    d = w.step()
    scheduled = {c.type: c for c in w.status.conditions}["Scheduled"]
    assert scheduled.status == "False" and scheduled.reason == "Unschedulable"
    assert "Insufficient" not in scheduled.message
    assert d.requeue_after is not None and d.requeue_after <= 5
    w.pods = tried  # the scheduler has tried them now
    w.tick(d.requeue_after)
    w.step()
    scheduled = {c.type: c for c in w.status.conditions}["Scheduled"]
    assert "Insufficient nvidia.com/gpu" in scheduled.message
    assert w.events.count("Unschedulable") == 1
    assert w.step().requeue_after is None  # the reason is named: no more looking again


def test_without_a_schedulers_reason_the_look_again_is_bounded():
    w = _world(scheduling={"schedulingTimeoutSeconds": 5})
    w.step()
    w.pods = {name: replace(pod, unschedulable="") for name, pod in w.pods.items()}
    w.tick(6)
    assert w.step().requeue_after is not None
    w.tick(120)  # a scheduler that never says why: pod events reconcile the job
    assert w.step().requeue_after is None
    assert {c.type: c.status for c in w.status.conditions}["Scheduled"] == "False"


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        (dict(phase="Failed", exit_code=137, terminated_reason="OOMKilled"), P.OOM),
        (dict(phase="Failed", pod_reason="Evicted"), P.EVICTED),
        (dict(phase="Failed", pod_reason="Preempting"), P.PREEMPTED),
        (dict(phase="Unknown"), P.NODE_LOST),
        (dict(phase="Failed", exit_code=1), P.ERROR),
    ],
)
def test_retryable_failure_restarts_the_trainer_gang_after_backoff(kwargs, kind):
    """One rank's failure breaks the others (torchrun restarts nothing, the rendezvous
    lives on trainer-0): every trainer pod is replaced, the rollout pods stay."""
    w = _world(trainer={"replicas": {"min": 1, "max": 2}})
    w.step()
    w.run_all()
    uid = w.pods["tiny-grpo-trainer-0"].uid
    w.report = TrainerReport(pod_uid=uid, step=2, last_checkpoint=_checkpoint(2))
    w.step()
    w.report = None
    old_uid = w.pods["tiny-grpo-trainer-1"].uid
    w.set("tiny-grpo-trainer-1", **kwargs)
    d = w.step()
    assert sorted(d.delete_pods) == ["tiny-grpo-trainer-0", "tiny-grpo-trainer-1"]
    assert w.status.restarts == 1 and w.status.last_failure.reason == kind
    assert w.status.last_failure.pod == "tiny-grpo-trainer-1"
    assert w.status.phase == "Restarting" and "Restarting" in w.events
    assert w.status.resume == "latest-healthy"
    w.tick(9)
    assert w.step().create == []  # backoff: 10 s
    w.tick(1)
    d = w.step()
    created = [m["metadata"]["name"] for m in d.create]
    # The token's Secret goes with each round of pods (kept if it exists).
    assert created == [
        "tiny-grpo-tokens-0f0e-uid",
        "tiny-grpo-ingress-0f0e-uid",
        "tiny-grpo-trainer-0",
        "tiny-grpo-trainer-1",
    ]
    assert "--resume=latest-healthy" in d.create[2]["spec"]["containers"][0]["command"]
    assert w.pods["tiny-grpo-trainer-1"].uid != old_uid
    w.run_all()
    w.step()
    assert w.status.phase == "Running" and w.status.restarts == 1


def test_a_gang_restart_cut_short_before_its_deletes_still_replaces_every_rank():
    """The status of a gang restart was written (failure counted, new rendezvous), then
    the operator died before deleting the pods: the surviving rank, still running in the
    old rendezvous, is deleted by the next reconcile, and the new gang is whole."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-1", phase="Failed", exit_code=1)
    before = dict(w.pods)
    d = w.step()
    assert sorted(d.delete_pods) == ["tiny-grpo-trainer-0", "tiny-grpo-trainer-1"]
    w.pods = before  # none of the deletes happened
    d = w.step()
    assert sorted(d.delete_pods) == ["tiny-grpo-trainer-0", "tiny-grpo-trainer-1"]
    assert w.status.restarts == 1
    w.tick(60)
    created = [m for m in w.step().create if m["kind"] == "Pod"]
    assert sorted(m["metadata"]["name"] for m in created) == [
        "tiny-grpo-trainer-0",
        "tiny-grpo-trainer-1",
    ]
    rendezvous = {
        c for m in created for c in m["spec"]["containers"][0]["command"] if "rdzv-id" in c
    }
    assert len(rendezvous) == 1 and rendezvous.pop().endswith("-1")  # one new attempt


def test_backoff_doubles_and_max_restarts_fails_the_job():
    w = _world()
    w.step()
    waits = []
    for _ in range(RESTARTS["maxRestarts"]):
        w.run_all()
        w.step()
        w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=137, terminated_reason="OOMKilled")
        w.step()
        start = w.now
        while "tiny-grpo-trainer-0" not in w.pods:
            w.tick(1)
            w.step()
        waits.append((w.now - start).total_seconds())
    assert waits == [10, 20, 40]
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=137, terminated_reason="OOMKilled")
    d = w.step()
    assert w.status.phase == "Failed" and w.status.last_failure.reason == "TooManyRestarts"
    assert "tiny-grpo-rollout-0" in d.delete_pods  # the GPUs are freed
    assert "tiny-grpo-trainer-0" not in d.delete_pods  # the failed pod stays for its logs
    w.tick(3600)
    assert w.step().create == []


def test_rendezvous_timeout_restarts_the_whole_gang():
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-1", phase="Failed", exit_code=1, message="RendezvousTimeoutError")
    d = w.step()
    assert sorted(d.delete_pods) == ["tiny-grpo-trainer-0", "tiny-grpo-trainer-1"]
    assert w.status.restarts == 1 and w.status.phase == "Restarting"


def test_permanent_error_fails_fast():
    w = _world()
    w.step()
    w.run_all()
    w.step()
    # torchrun's agent exits 1; the worker's verdict in the termination message says 2.
    verdict = Verdict(ExitCode.INVALID_CONFIG, "spec.x: unknown field")
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1, verdict=verdict)
    w.step()
    assert w.status.phase == "Failed" and w.status.last_failure.reason == P.INVALID_CONFIG
    assert w.status.restarts == 0 and "spec.x" in w.status.last_failure.message
    assert w.status.last_failure.exit_code == ExitCode.INVALID_CONFIG


def test_log_text_is_never_copied_into_the_status():
    w = _world()
    w.step()
    w.run_all()
    w.step()
    log = "Traceback (most recent call last):\n  token=hunter2 in some frame\nRuntimeError: x"
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1, message=log)
    w.step()
    assert w.status.last_failure.reason == P.ERROR and w.status.last_failure.message == ""
    assert "hunter2" not in w.status.model_dump_json()


def _checkpoint(step: int) -> dict[str, Any]:
    return {"step": step, "uri": f"s3://b/run/step-{step:06d}", "time": "2026-01-01T00:00:00Z"}


def test_status_mirrors_the_trainer_report_and_keeps_the_checkpoint():
    w, uid = _running_world()
    w.report = TrainerReport(
        pod_uid=uid,
        step=120,
        policy_version=120,
        reward=0.75,
        last_checkpoint=_checkpoint(100),
        last_healthy_checkpoint=_checkpoint(100),
    )
    w.step()
    st = w.status
    assert (st.step, st.policy_version, st.reward) == (120, 120, 0.75)
    assert st.last_checkpoint.step == 100 and st.last_checkpoint.healthy is True
    assert {c.type: c.status for c in st.conditions}["Checkpointed"] == "True"
    assert "Checkpointed" in w.events
    w.report = TrainerReport(pod_uid=uid, step=121)  # a fresh trainer: nothing saved yet
    w.step()
    assert w.status.last_checkpoint.step == 100


def test_a_checkpoint_newer_than_the_last_healthy_one_is_not_marked_healthy() -> None:
    """A report whose last checkpoint does not say whether it is healthy: it is healthy
    only when it is the last healthy one, not whenever some healthy one exists."""
    w, uid = _running_world()
    w.report = TrainerReport(
        pod_uid=uid,
        step=120,
        last_checkpoint=_checkpoint(110),
        last_healthy_checkpoint=_checkpoint(100),
    )
    w.step()
    assert w.status.last_checkpoint is not None and w.status.last_healthy_checkpoint is not None
    assert w.status.last_checkpoint.step == 110 and w.status.last_checkpoint.healthy is False
    assert w.status.last_healthy_checkpoint.step == 100


def test_a_trainer_reporting_fewer_rollbacks_does_not_lower_the_count() -> None:
    """The job's rollback count only grows: a trainer that resumed from a checkpoint
    written before its last rollback reports the smaller count it holds."""
    w, uid = _running_world()
    w.report = TrainerReport(pod_uid=uid, step=60, rollbacks=2)
    w.step()
    assert w.status.rollbacks == 2
    w.report = TrainerReport(pod_uid=uid, step=40, rollbacks=1)
    w.step()
    assert w.status.rollbacks == 2


def test_the_final_checkpoint_in_the_verdict_replaces_an_older_one_in_status() -> None:
    """/status named step 10's checkpoint; the trainer then finished with step 12's
    before the next poll: the job shows the final one."""
    w, uid = _running_world()
    w.report = TrainerReport(pod_uid=uid, step=10, last_checkpoint=_checkpoint(10))
    w.step()
    assert w.status.last_checkpoint is not None and w.status.last_checkpoint.step == 10
    w.report = None
    done = Verdict(0, completed=True, step=12, last_checkpoint=12, checkpoint_uri="s3://b/r/s")
    w.set("tiny-grpo-trainer-0", phase="Succeeded", exit_code=0, verdict=done)
    w.step()
    assert w.status.phase == "Succeeded"
    assert w.status.last_checkpoint is not None
    assert (w.status.last_checkpoint.step, w.status.last_checkpoint.uri) == (12, "s3://b/r/s")


@pytest.mark.parametrize("phase", ["starting", "warm_start"])
def test_a_trainer_not_yet_training_leaves_step_and_version_as_they_were(phase):
    """A restarted trainer serves /status (step 0, version 0) before it restores its
    checkpoint: the job's step and policy version used to drop to 0 after every restart."""
    w, uid = _running_world()
    w.report = TrainerReport(pod_uid=uid, step=50, policy_version=50, phase="training")
    w.step()
    w.report = TrainerReport(pod_uid=uid, step=0, policy_version=0, phase=phase)
    w.step()
    assert (w.status.step, w.status.policy_version) == (50, 50)
    w.report = TrainerReport(pod_uid=uid, step=48, policy_version=48, phase="training")
    w.step()  # resumed from an older checkpoint: that is where the job is now
    assert (w.status.step, w.status.policy_version) == (48, 48)


def test_a_collapse_in_status_is_shown_and_left_to_the_trainer():
    """One owner: the trainer rolls back in process. The operator mirrors what it sees
    (Healthy=False, one Event, the trainer's rollback count) and restarts nothing."""
    w = _world(stability={"onCollapse": "rollback", "maxRollbacks": 1})
    w.step()
    w.run_all()
    w.step()
    uid = w.pods["tiny-grpo-trainer-0"].uid
    w.report = TrainerReport(pod_uid=uid, step=60, health="collapsed", rollbacks=1)
    for _ in range(3):
        d = w.step()
        assert d.delete_pods == [] and d.create == []
    assert w.status.phase == "Running" and w.status.restarts == 0 and w.status.rollbacks == 1
    assert w.events.count("Collapsed") == 1
    healthy = {c.type: c for c in w.status.conditions}["Healthy"]
    assert healthy.status == "False" and healthy.reason == "Collapsed"


def test_a_run_the_trainers_guard_ended_fails_the_job():
    w = _world(stability={"onCollapse": "rollback", "maxRollbacks": 1})
    w.step()
    w.run_all()
    w.step()
    ended = Verdict(ExitCode.COLLAPSED, "collapse at step 9 (nan); failing", collapsed=True)
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1, verdict=ended)
    d = w.step()
    assert w.status.phase == "Failed" and w.status.last_failure.reason == P.COLLAPSED
    assert "collapse at step 9" in w.status.message and w.status.restarts == 0
    assert not any(m["kind"] == "Pod" for m in d.create)


def test_suspend_and_resume():
    w = _world(checkpoint={"uri": "s3://bucket/run", "resume": "never"})
    first = next(m for m in w.step().create if m["metadata"]["name"] == "tiny-grpo-trainer-0")
    w.run_all()
    # The gang trained (a step reported, no checkpoint yet): SIGTERM at the suspend makes
    # it write an emergency checkpoint, which the resumed gang takes.
    w.report = TrainerReport(pod_uid=w.pods["tiny-grpo-trainer-0"].uid, step=3)
    w.step()
    w.report = None
    w.spec["suspend"] = True
    d = w.step()
    assert sorted(d.delete_pods) == ["tiny-grpo-rollout-0", "tiny-grpo-trainer-0"]
    assert w.status.phase == "Suspended" and w.pods == {}
    assert _condition(w, "Scheduled") == ("False", "Suspended")
    assert w.step().create == []
    w.spec["suspend"] = False
    d = w.step()
    assert w.status.phase == "Pending" and "Resumed" in w.events
    trainer = next(m for m in d.create if m["metadata"]["name"] == "tiny-grpo-trainer-0")
    assert "--resume=latest-healthy" in trainer["spec"]["containers"][0]["command"]
    # A rendezvous of its own: the resumed agents never join the suspended gang's.
    rdzv = [
        [a for a in m["spec"]["containers"][0]["command"] if a.startswith("--rdzv-id=")]
        for m in (first, trainer)
    ]
    assert rdzv[0] and rdzv[1] and rdzv[0] != rdzv[1]
    w.run_all()
    w.step()
    assert w.status.phase == "Running"
    assert _condition(w, "Scheduled") == ("True", "GangScheduled")


def test_a_resume_does_not_wait_out_a_backoff_the_suspend_interrupted() -> None:
    """A job suspended during a restart's backoff: its pods were all deleted, so the
    resume starts them at once, not when the old backoff would have ended."""
    w = _world(restartPolicy={**RESTARTS, "backoffSeconds": 600})
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1)
    w.step()
    assert w.status.next_restart_at is not None
    w.spec["suspend"] = True
    w.step()
    assert w.status.phase == "Suspended" and w.status.next_restart_at is None
    w.tick(5)
    w.spec["suspend"] = False
    d = w.step()
    assert {m["metadata"]["name"] for m in d.create if m["kind"] == "Pod"} == {
        "tiny-grpo-trainer-0",
        "tiny-grpo-rollout-0",
    }


def _condition(w: World, kind: str) -> tuple[str, str]:
    (condition,) = [c for c in w.status.conditions if c.type == kind]
    return condition.status, condition.reason


@pytest.mark.parametrize("choice", ["auto", "never"])
def test_a_job_created_suspended_starts_with_its_own_resume_choice(choice):
    """Nothing of the job has run: releasing it is its first start, and an edit of
    checkpoint.resume made meanwhile applies."""
    w = _world(suspend=True, checkpoint={"uri": "s3://bucket/run", "resume": "latest-healthy"})
    d = w.step()
    assert w.status.phase == "Suspended" and not any(m["kind"] == "Pod" for m in d.create)
    w.edit(suspend=False, checkpoint={"uri": "s3://bucket/run", "resume": choice})
    d = w.step()
    trainer = next(m for m in d.create if m["metadata"]["name"] == "tiny-grpo-trainer-0")
    assert trainer["spec"]["containers"][0]["command"][-1] == f"--resume={choice}"


def test_success_frees_the_rollout_pods():
    w = _world()
    w.step()
    w.run_all()
    w.step()
    done = Verdict(0, completed=True, step=12, last_checkpoint=12, checkpoint_uri="s3://b/r/s")
    w.set("tiny-grpo-trainer-0", phase="Succeeded", exit_code=0, verdict=done)
    d = w.step()
    assert w.status.phase == "Succeeded" and d.delete_pods == ["tiny-grpo-rollout-0"]
    assert w.status.step == 12 and w.status.last_checkpoint.step == 12  # mirrored at the end
    assert _condition(w, "Scheduled") == ("False", "Succeeded")
    assert w.step().create == []


def test_only_rank_0_reporting_completion_makes_the_job_succeed():
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    # Rank 1 is done while rank 0 still publishes the outputs: the job waits.
    w.set("tiny-grpo-trainer-1", phase="Succeeded", exit_code=0, verdict=Verdict(0, rank=1))
    d = w.step()
    assert w.status.phase == "Running" and d.delete_pods == [] and d.create == []
    w.set("tiny-grpo-trainer-0", phase="Succeeded", exit_code=0, verdict=Verdict(0, completed=True))
    w.step()
    assert w.status.phase == "Succeeded"


def test_trainers_that_all_exit_0_without_completion_are_restarted():
    """E.g. stopped after an emergency checkpoint: not a success, a gang restart."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    for rank in (0, 1):
        name = f"tiny-grpo-trainer-{rank}"
        w.set(name, phase="Succeeded", exit_code=0, verdict=Verdict(0, rank=rank))
    d = w.step()
    assert w.status.phase == "Restarting" and w.status.restarts == 1
    assert sorted(d.delete_pods) == ["tiny-grpo-trainer-0", "tiny-grpo-trainer-1"]
    assert "before rank 0 reported" in w.status.last_failure.message


def test_image_pull_warns_then_fails_after_the_timeout():
    w = _world(scheduling={"schedulingTimeoutSeconds": 100})
    w.step()
    w.set("tiny-grpo-rollout-0", waiting="ImagePullBackOff")
    w.step()
    ready = {c.type: c for c in w.status.conditions}["Ready"]
    assert ready.reason == P.IMAGE_PULL and w.events.count(P.IMAGE_PULL) == 1
    w.step()
    assert w.events.count(P.IMAGE_PULL) == 1
    w.tick(101)
    w.step()
    assert w.status.phase == "Failed" and w.status.last_failure.reason == P.IMAGE_PULL


def test_two_pods_that_cannot_start_for_different_reasons_warn_once_each():
    """The Ready condition took each pod's reason in turn, so each reconcile found both
    problems new: two Warnings every poll until the scheduling timeout."""
    w = _world(scheduling={"schedulingTimeoutSeconds": 100})
    w.step()
    w.set("tiny-grpo-rollout-0", waiting="ImagePullBackOff")
    w.set("tiny-grpo-trainer-0", waiting="CreateContainerConfigError")
    for _ in range(4):
        w.step()
    assert w.events.count(P.IMAGE_PULL) + w.events.count(P.CONFIG_ERROR) == 1, w.events
    assert w.status.phase != "Failed"


def test_a_pod_being_deleted_that_cannot_pull_its_image_does_not_fail_the_job() -> None:
    """A wrong image fixed with a suspend and an edit: the old rollout pod (an invalid
    image name, a permanent problem) is still terminating when the job resumes. It is
    going away: its pull is no longer the job's problem."""
    w = _world()
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-rollout-0", waiting="InvalidImageName", deleting=True)
    w.step()
    assert w.status.phase == "Running", w.status.message
    assert P.IMAGE_PULL not in w.events


def test_ready_needs_every_pod_of_the_job_running() -> None:
    w = _world()
    w.step()
    w.set("tiny-grpo-trainer-0", phase="Running")
    w.step()
    assert w.status.phase == "Running"
    assert _condition(w, "Ready") == ("False", "PodsNotRunning")  # the rollout pod is not
    w.run_all()
    w.step()
    assert _condition(w, "Ready") == ("True", "AllPodsRunning")


def test_the_status_forgets_handled_pods_once_they_are_gone() -> None:
    """status.handledPods names the judged pods that still exist: a job that restarts
    often must not grow it without bound."""
    w = _world()
    w.step()
    w.run_all()
    w.step()
    uid = w.pods["tiny-grpo-trainer-0"].uid
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1)
    w.step()  # judged, and deleted
    assert uid in w.status.handled_pods and "tiny-grpo-trainer-0" not in w.pods
    w.step()
    assert uid not in w.status.handled_pods


def test_scaling_down_restarts_the_gang_without_the_extra_slot():
    """Every agent has --nnodes in its command: the gang restarts with the new one
    (test_operator_spec_changes.py has the rules), not counted as a failure."""
    w = _world(trainer={"replicas": {"min": 1, "max": 3}})
    w.step()
    w.spec["trainer"] = {"replicas": {"min": 1, "max": 2}}
    d = w.step()
    assert sorted(d.delete_pods) == [f"tiny-grpo-trainer-{i}" for i in range(3)]
    assert w.status.restarts == 0
    d = w.step()
    assert sorted(m["metadata"]["name"] for m in d.create) == [
        "tiny-grpo-ingress-0f0e-uid",
        "tiny-grpo-tokens-0f0e-uid",
        "tiny-grpo-trainer-0",
        "tiny-grpo-trainer-1",
    ]


# --------------------------------------------------------------- property tests

POD_EVENTS = st.sampled_from(
    [
        "run",
        "oom",
        "evict",
        "exit1",
        "exit2",
        "exit3",
        "rdzv",
        "lost",
        "succeed",
        "vanish",
        "pull",
        "schedule",
    ]
)
ACTIONS = st.one_of(
    st.tuples(st.just("pod"), st.integers(0, 4), POD_EVENTS),
    st.tuples(st.just("tick"), st.integers(0, 400), st.just("")),
    st.tuples(st.just("report"), st.integers(0, 500), st.sampled_from(["ok", "collapsed", "none"])),
    st.tuples(st.just("suspend"), st.just(0), st.sampled_from(["on", "off"])),
)
EFFECTS = {
    "run": dict(phase="Running", pod_ip="10.0.0.9"),
    "oom": dict(phase="Failed", exit_code=137, terminated_reason="OOMKilled"),
    "evict": dict(phase="Failed", pod_reason="Evicted"),
    "exit1": dict(phase="Failed", exit_code=1),
    "exit2": dict(phase="Failed", exit_code=2),
    "exit3": dict(phase="Failed", exit_code=3),
    "rdzv": dict(phase="Failed", exit_code=1, message="DistNetworkError: connectFullMesh"),
    "lost": dict(phase="Unknown"),
    "succeed": dict(phase="Succeeded", exit_code=0),
    "pull": dict(waiting="ErrImagePull"),
    "schedule": dict(scheduled=True),
}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(ACTIONS, max_size=40),
    st.sampled_from(["rollback", "suspend", "fail", "alert"]),
    st.integers(1, 3),
)
def test_no_sequence_breaks_the_invariants(actions, on_collapse, replicas_max):
    w = _world(
        trainer={"replicas": {"min": 1, "max": replicas_max}},
        stability={"onCollapse": on_collapse, "maxRollbacks": 2},
        rollout={"instances": 2},
    )
    w.step()
    for kind, number, what in actions:
        if kind == "pod" and w.pods:
            names = sorted(w.pods)
            name = names[number % len(names)]
            if what == "vanish":
                w.pods.pop(name)
            else:
                w.set(name, **EFFECTS[what])
        elif kind == "tick":
            w.tick(number)
        elif kind == "report":
            trainers = [p for p in w.pods.values() if p.role == "trainer"]
            w.report = (
                None
                if what == "none" or not trainers
                else TrainerReport(
                    pod_uid=trainers[0].uid,
                    step=number,
                    health=what,
                    last_checkpoint=_checkpoint(number) if number % 2 else None,
                )
            )
        elif kind == "suspend":
            w.spec["suspend"] = what == "on"
        w.step()  # World.check asserts the invariants after every reconcile
    # one pod per slot, always
    slots = [(p.role, p.index) for p in w.pods.values()]
    assert len(slots) == len(set(slots))
    assert w.status.rollbacks <= 2


def test_a_trainer_pod_that_vanishes_restarts_the_gang():
    """Deleted by someone (a drain, a preemption) or gone with its node: the survivors'
    ranks cannot go on, so they are replaced too, and it counts as a restart."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    w.pods.pop("tiny-grpo-trainer-0")
    d = w.step()
    assert d.delete_pods == ["tiny-grpo-trainer-1"] and w.status.restarts == 1
    assert (
        "trainer pod tiny-grpo-trainer-0 of the running gang is gone"
        in w.status.last_failure.message
    )
    w.tick(10)
    created = [m["metadata"]["name"] for m in w.step().create]
    assert created == [
        "tiny-grpo-tokens-0f0e-uid",
        "tiny-grpo-ingress-0f0e-uid",
        "tiny-grpo-trainer-0",
        "tiny-grpo-trainer-1",
    ]


def test_a_run_the_trainer_paused_after_a_collapse_is_suspended_not_restarted():
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    paused = Verdict(0, "collapse at step 9 (reward collapse); paused", collapsed=True)
    handled = w.pods["tiny-grpo-trainer-0"].uid
    w.set("tiny-grpo-trainer-0", phase="Succeeded", exit_code=0, verdict=paused)
    w.set("tiny-grpo-trainer-1", phase="Succeeded", exit_code=0, verdict=Verdict(0, rank=1))
    d = w.step()
    assert d.set_suspend and w.status.restarts == 0 and d.create == []
    assert w.status.last_failure.reason == P.COLLAPSED and "paused" in w.status.last_failure.message
    # The status was written but the spec.suspend patch never landed (the operator died
    # between the two writes): the next reconcile asks again instead of restarting.
    w.spec["suspend"] = False
    for _ in range(3):
        w.tick(30)
        d = w.step()
        assert d.set_suspend and d.create == [] and d.delete_pods == []
        w.spec["suspend"] = False
    assert w.status.restarts == 0 and w.events.count("Collapsed") == 1
    w.spec["suspend"] = True  # it lands
    w.step()
    assert w.status.phase == "Suspended" and w.pods == {}
    # Resumed by the user while a paused pod is still being deleted: not suspended again.
    w.pods["tiny-grpo-trainer-0"] = view(
        "tiny-grpo-trainer-0", "trainer", 0, uid=handled, phase="Succeeded", exit_code=0,
        verdict=paused, deleting=True,
    )  # fmt: skip
    w.spec["suspend"] = False
    d = w.step()
    assert not d.set_suspend and w.status.phase == "Pending"


@pytest.mark.parametrize(
    ("disruption", "kind"),
    [("PreemptionByScheduler", P.PREEMPTED), ("EvictionByEvictionAPI", P.EVICTED)],
)
def test_a_preempted_or_evicted_trainer_pod_is_judged_while_it_is_being_deleted(disruption, kind):
    """The pod carries a deletion timestamp and a DisruptionTarget condition. While it
    runs (its emergency checkpoint, in the grace) nothing happens; once its container
    ended it is judged (not skipped as one being deleted) and the gang restarts."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-1", phase="Running", deleting=True, disruption=disruption)
    d = w.step()
    assert d.delete_pods == [] and w.status.restarts == 0  # the grace is the pod's own
    w.set(
        "tiny-grpo-trainer-1", phase="Failed", exit_code=137, deleting=True, disruption=disruption
    )
    d = w.step()
    assert w.status.last_failure.reason == kind and w.status.restarts == 1
    assert w.status.restart_history == []  # a disruption: not counted
    assert d.delete_pods == ["tiny-grpo-trainer-0"]  # the other is already going


def _restart_after(w: World, name: str, **failed: Any) -> float:
    """Fail `name` as given, and return how long the operator waited to recreate it."""
    w.run_all()
    w.step()
    w.set(name, **failed)
    w.step()
    if failed.get("deleting"):
        del w.pods[name]  # judged, its end seen: the API server removes it
    start = w.now
    while name not in w.pods:
        assert w.status.phase != "Failed", w.status.last_failure
        w.tick(1)
        w.step()
    return (w.now - start).total_seconds()


DISRUPTIONS = [
    ("PreemptionByScheduler", P.PREEMPTED),
    ("EvictionByEvictionAPI", P.EVICTED),
    ("TerminationTarget/StoppedByKueue", P.PREEMPTED),  # Kueue's, older releases
    ("TerminationTarget/WorkloadEvictedDueToPreempted", P.PREEMPTED),  # newer
    ("DeletionByTaintManager", P.NODE_LOST),
]


@pytest.mark.parametrize(("disruption", "kind"), DISRUPTIONS)
def test_disruptions_are_not_counted_against_max_restarts(disruption, kind):
    """A job on preemptible capacity is preempted (drained, its node lost, its Kueue
    workload evicted) more often than maxRestarts in the window: it restarts each time,
    after backoffSeconds (not doubled), and is never failed for it."""
    w = _world()
    w.step()
    taken = {"phase": "Failed", "exit_code": 0, "deleting": True, "disruption": disruption}
    waits = [
        _restart_after(w, "tiny-grpo-trainer-0", **taken)
        for _ in range(RESTARTS["maxRestarts"] + 2)
    ]
    assert waits == [10] * (RESTARTS["maxRestarts"] + 2)
    assert w.status.phase != "Failed" and w.status.restart_history == []
    assert w.status.restarts == RESTARTS["maxRestarts"] + 2
    assert w.status.last_failure.reason == kind
    assert "a disruption, not counted against restartPolicy" in w.status.last_failure.action


def test_disruptions_are_counted_when_the_restart_policy_says_so():
    w = World(spec={"restartPolicy": {**RESTARTS, "countDisruptions": True}})
    w.step()
    taken = {"phase": "Failed", "exit_code": 0, "deleting": True}
    waits = [
        _restart_after(w, "tiny-grpo-trainer-0", **taken, disruption="PreemptionByScheduler")
        for _ in range(RESTARTS["maxRestarts"])
    ]
    assert waits == [10, 20, 40]
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-0", **taken, disruption="PreemptionByScheduler")
    w.step()
    assert w.status.phase == "Failed" and w.status.last_failure.reason == "TooManyRestarts"


def test_a_kubelet_eviction_for_node_pressure_is_counted():
    """The pod itself may have filled the node's disk or memory: not a disruption."""
    w = _world()
    w.step()
    _restart_after(
        w,
        "tiny-grpo-trainer-0",
        phase="Failed",
        pod_reason="Evicted",
        disruption="TerminationByKubelet",
    )
    assert w.status.last_failure.reason == P.EVICTED and len(w.status.restart_history) == 1


@pytest.mark.parametrize("seen_taken", [True, False])
def test_a_trainer_pod_gone_before_its_end_was_seen(seen_taken):
    """A preempted pod's object goes as soon as its container ends, so the operator may
    never see it ended: seen with the scheduler's DisruptionTarget while it ran its
    grace, it is a preemption (not counted); seen only running, it is an error."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    if seen_taken:
        w.set(
            "tiny-grpo-trainer-1",
            phase="Running",
            deleting=True,
            disruption="PreemptionByScheduler",
        )
        w.step()
    del w.pods["tiny-grpo-trainer-1"]
    d = w.step()
    assert d.delete_pods == ["tiny-grpo-trainer-0"]  # the gang restarts
    failure = w.status.last_failure
    if seen_taken:
        assert failure.reason == P.PREEMPTED and w.status.restart_history == []
        assert "PreemptionByScheduler" in failure.message
    else:
        assert failure.reason == P.ERROR and len(w.status.restart_history) == 1
    assert w.status.gang_disruptions == []  # nothing left of the old gang


def _running_gang_and_an_eviction() -> tuple[World, dict[str, Any]]:
    """A running 2-pod gang, and the pod fields of a taint-manager eviction (its grace
    ending in 30 s)."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    grace_ends = (w.now + timedelta(seconds=30)).isoformat()
    return w, {"deleting": True, "grace_ends": grace_ends, "disruption": "DeletionByTaintManager"}


def test_a_pod_stuck_terminating_past_its_grace_is_force_deleted_and_replaced():
    """A lost node's pod, evicted by the taint manager, keeps its deletion timestamp for
    ever (no kubelet finishes it) and holds its slot's name: once STUCK_TERMINATING_SECONDS
    past its grace it is force-deleted (one Event), and the gang restarts without it."""
    w, evicted = _running_gang_and_an_eviction()
    w.set("tiny-grpo-trainer-1", phase="Running", **evicted)
    w.tick(30 + STUCK_TERMINATING_SECONDS - 1)
    d = w.step()
    assert d.force_delete_pods == [] and d.requeue_after is not None and d.requeue_after <= 1
    w.tick(1)
    d = w.step()
    assert d.force_delete_pods == ["tiny-grpo-trainer-1"] and "ForceDeleted" in w.events
    d = w.step()  # the slot is empty now: the gang restarts
    assert w.status.restarts == 1 and d.delete_pods == ["tiny-grpo-trainer-0"]


def test_a_pod_evicted_from_a_node_that_stopped_reporting_is_force_deleted_at_once():
    """The node lifecycle controller marked the pod not ready (its node went silent) and,
    nodeLostSeconds later, the taint manager evicted it: no kubelet will run its shutdown,
    so its grace is not waited out. It is a NodeLost failure of the gang, and its slot is
    freed at once. A pod evicted from a node whose kubelet still reports stays ready
    while it stops, and keeps its grace."""
    w, evicted = _running_gang_and_an_eviction()
    w.set("tiny-grpo-trainer-1", phase="Running", ready=True, **evicted)
    d = w.step()
    assert d.force_delete_pods == [] and "ForceDeleted" not in w.events
    w.set("tiny-grpo-trainer-1", phase="Running", ready=False, **evicted)
    d = w.step()
    assert d.force_delete_pods == ["tiny-grpo-trainer-1"] and "ForceDeleted" in w.events
    assert w.status.last_failure.reason == P.NODE_LOST
    assert "tiny-grpo-trainer-0" in d.delete_pods  # the gang restarts without waiting


def test_a_pod_a_finalizer_holds_is_force_deleted_again_with_one_event():
    """A force-deleted pod a finalizer holds (Kueue's, say) stays: the delete is repeated
    each reconcile, its Event is not (one Warning every 15 s flooded the job's Events)."""
    w, evicted = _running_gang_and_an_eviction()
    w.set("tiny-grpo-trainer-1", phase="Running", ready=False, **evicted)
    held = w.pods["tiny-grpo-trainer-1"]
    for _ in range(3):
        d = w.step()
        assert "tiny-grpo-trainer-1" in d.force_delete_pods
        w.pods["tiny-grpo-trainer-1"] = held  # the finalizer keeps it
        w.tick(15)
    assert w.events.count("ForceDeleted") == 1, w.events


OOM_KILLED = {"phase": "Failed", "exit_code": 137, "terminated_reason": "OOMKilled"}


def _peer_fails_first() -> tuple[World, Decision, str]:
    """A running 2-pod gang whose trainer-1 fails (its collective broke when trainer-0's
    worker was OOM-killed): the world, that decision and trainer-0's uid."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    uid = w.pods["tiny-grpo-trainer-0"].uid
    w.set("tiny-grpo-trainer-1", phase="Failed", exit_code=1)
    return w, w.step(), uid


def _assert_the_oom_is_named_once(w: World) -> None:
    w.step()
    w.step()
    assert w.status.restarts == 1
    assert (w.status.last_failure.reason, w.status.last_failure.pod) == (
        P.OOM,
        "tiny-grpo-trainer-0",
    )
    assert w.events.count(P.OOM) == 1


def test_an_oom_kill_judged_after_its_peers_failure_still_names_the_cause():
    """trainer-1 fails first (its collective broke when trainer-0's worker was OOM-killed);
    the gang restart marks trainer-0 handled. When trainer-0 ends OOMKilled, that becomes
    the last failure, with one Event, and the restart is not counted twice."""
    w, d, uid = _peer_fails_first()
    assert "tiny-grpo-trainer-0" in d.delete_pods  # the survivor too: the gang restarts
    assert w.status.restarts == 1 and w.status.last_failure.pod == "tiny-grpo-trainer-1"
    # Deleted gracefully, the pod is still there, Terminating, when its container ends.
    w.pods["tiny-grpo-trainer-0"] = view(
        "tiny-grpo-trainer-0", uid=uid, deleting=True, **OOM_KILLED
    )
    _assert_the_oom_is_named_once(w)


def test_an_oom_kill_seen_only_in_a_gone_pods_final_status_still_names_the_cause():
    """The same race, with the OOM-killed pod already deleted when the planner runs: its
    final status (reason OOMKilled) was seen in a pod event just before its delete."""
    w, _, uid = _peer_fails_first()
    assert "tiny-grpo-trainer-0" not in w.pods and w.status.last_failure.reason != P.OOM
    w.oom_killed = [view("tiny-grpo-trainer-0", uid=uid, deleting=True, **OOM_KILLED)]
    _assert_the_oom_is_named_once(w)


def test_two_ranks_oom_killed_together_name_one_cause_once():
    """Both ranks OOM-killed (ranks use memory alike): each reconcile named the one that
    was not the last failure, flipping between them with a Warning each time, and each
    status write kicked the next reconcile at once, for as long as the pods remained."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    names = ("tiny-grpo-trainer-0", "tiny-grpo-trainer-1")
    uids = {name: w.pods[name].uid for name in names}
    for name in names:
        w.set(name, **OOM_KILLED)
    w.step()
    first, events = w.status.last_failure.pod, len(w.events)
    for _ in range(4):  # still Terminating, both OOMKilled
        for name in names:
            w.pods[name] = view(name, uid=uids[name], deleting=True, **OOM_KILLED)
        w.step()
    assert (w.status.last_failure.reason, w.status.last_failure.pod) == (P.OOM, first)
    assert len(w.events) == events and w.status.restarts == 1, w.events


def _rdzv_ids(d: Decision) -> set[str]:
    commands = [m["spec"]["containers"][0]["command"] for m in d.create if m["kind"] == "Pod"]
    return {a for c in commands for a in c if a.startswith("--rdzv-id=")}


def test_a_restarted_gang_meets_at_a_rendezvous_of_its_own():
    """The old trainer-0, still terminating, hosts the rendezvous its gang closed when it
    failed; a new trainer-1 joining that one would fail at once (RendezvousClosedError),
    restart after restart. Each gang attempt has its own rendezvous id."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    first = _rdzv_ids(w.step())
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-1", phase="Failed", exit_code=1)
    w.step()
    w.tick(10)
    second = _rdzv_ids(w.step())
    assert len(first) == len(second) == 1 and first != second, (first, second)
    assert w.status.gang_attempt == 1


def test_a_gang_that_cannot_meet_for_want_of_a_node_waits_without_spending_restarts():
    """trainer-1 has no node (Unschedulable); trainer-0's agent gives up on the
    rendezvous. That is waiting for capacity: the gang's rendezvous restarts, with an
    Event, but the restart budget is untouched and the job never fails for it."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    for _ in range(RESTARTS["maxRestarts"] + 2):
        w.set("tiny-grpo-trainer-0", phase="Running", pod_ip="10.0.0.1")
        w.step()
        message = "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"
        w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1, message=message)
        w.step()
        w.tick(30)
        w.step()
    assert w.status.phase != "Failed" and w.status.restart_history == []
    assert w.events.count("Waiting") == RESTARTS["maxRestarts"] + 2


def test_an_image_pull_error_on_a_node_that_came_late_is_timed_from_its_placement():
    """A pod waited 601 s for capacity (allowed: a condition, no failure), then its node's
    first pull of the image fails (a registry's 429): that is waiting to start, timed
    from when it got its node. It was timed from the pod's creation, and failed the job
    at once."""
    w = _world()
    w.step()
    w.tick(601)
    placed = w.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    w.set("tiny-grpo-trainer-0", scheduled=True, scheduled_at=placed, waiting="ErrImagePull")
    w.step()
    assert w.status.phase != "Failed", w.status.message
    ready = {c.type: c for c in w.status.conditions}["Ready"]
    assert (ready.status, ready.reason) == ("False", "ImagePull")
    w.tick(601)  # the registry keeps refusing: past schedulingTimeout from the placement
    w.step()
    assert w.status.phase == "Failed" and "for 601 s" in w.status.message


def test_a_pod_that_cannot_start_fails_the_job_when_the_requeue_it_asked_for_comes() -> None:
    """A pod in ErrImagePull asks to be looked at again when schedulingTimeoutSeconds
    (600) since its placement is up: at that moment it has waited long enough, and the
    job fails then (not one more requeue of 0 s later)."""
    w = _world()
    w.step()
    placed = w.now.strftime("%Y-%m-%dT%H:%M:%SZ")
    w.set("tiny-grpo-trainer-0", scheduled=True, scheduled_at=placed, waiting="ErrImagePull")
    d = w.step()
    assert w.status.phase != "Failed" and d.requeue_after == 600
    w.tick(600)
    w.step()
    assert w.status.phase == "Failed" and "for 600 s" in w.status.message


def test_a_running_gang_whose_member_is_being_lost_spends_a_restart():
    """The exemption is for a gang that could not meet. A gang that ran, losing a member
    (its node gone: deleted with a DisruptionTarget) while another rank's collective
    times out, spends its budget: it used to count as "unplaced" and restart for free,
    the lost pod marked handled, so a loss that kept coming never failed the job."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    w.step()
    w.run_all()
    w.step()
    assert len(w.status.gang_pods) == 2
    w.set(
        "tiny-grpo-trainer-1",
        phase="Running",
        deleting=True,
        disruption="DeletionByTaintManager",
    )
    message = "Watchdog caught collective operation timeout"
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1, message=message)
    w.step()
    assert len(w.status.restart_history) == 1, w.events
    assert "Waiting" not in w.events


def test_a_spec_pydantic_rejects_fails_the_job_and_frees_its_pods():
    """The API server's schema let it through (or an upgraded operator is stricter): the
    job fails naming the field, and its running pods are deleted like any failed job's;
    finished ones stay for their logs."""
    from rlft.operator.decision import invalid_spec

    pods = [
        view("tiny-grpo-trainer-0", "trainer", 0, phase="Running"),
        view("tiny-grpo-rollout-0", "rollout", 0, phase="Pending"),
        view("tiny-grpo-trainer-1", "trainer", 1, phase="Failed", exit_code=1),
    ]
    d = invalid_spec(RLFineTuneStatus(phase="Running"), ["spec.trainer.steps: too big"], T0, pods)
    assert d.status.phase == "Failed" and "spec.trainer.steps" in d.status.message
    assert d.delete_pods == ["tiny-grpo-rollout-0", "tiny-grpo-trainer-0"]
    assert [e.reason for e in d.events] == ["InvalidSpec"]
    again = invalid_spec(d.status, ["spec.trainer.steps: too big"], T0, [])
    assert again.events == [] and again.delete_pods == []  # said once


def test_a_multi_node_rollout_instance_restarts_whole_and_counts_once():
    """A Ray worker of a 3-node instance fails: its head's vLLM spans it and cannot go on.
    Only the worker was replaced (the head then failed too, a second counted restart, and
    the new worker joined a head whose engine was gone); the instance restarts whole."""
    multi = {"engine": "vllm", "gpusPerInstance": 3, "nodesPerInstance": 3, "instances": 2}
    w = _world(rollout=multi)
    w.step()
    names = sorted(w.pods)
    heads = [n for n in names if w.pods[n].role == "ray-head"]
    workers = [n for n in names if w.pods[n].role == "ray-worker"]
    assert len(heads) == 2 and len(workers) == 4
    w.run_all()
    w.step()
    broken = next(n for n in workers if w.pods[n].index == 1)
    w.set(broken, phase="Failed", exit_code=1)
    d = w.step()
    one = sorted(n for n in names if w.pods.get(n) is None)
    instance_1 = sorted(n for n in heads + workers if n.startswith("tiny-grpo-rollout-1"))
    assert sorted(d.delete_pods) == instance_1 == one, (d.delete_pods, instance_1)
    assert w.status.restarts == 1 and "rollout instance 1" in w.status.last_failure.action
    assert not any(n.startswith("tiny-grpo-rollout-0") for n in d.delete_pods)
    while not all(n in w.pods for n in instance_1):  # recreated after the backoff
        w.tick(1)
        w.step()
    assert w.status.restarts == 1  # the others' going was this restart's


def _env_names(manifest: dict[str, Any]) -> set[str]:
    return {e["name"] for e in manifest["spec"]["containers"][0].get("env") or []}


@pytest.mark.parametrize("old_trainers", [True, False])
def test_a_rollout_pod_made_for_trainers_without_a_token_gets_none(old_trainers):
    """The operator upgraded under a running job: its trainers, made before tokens, call
    the rollout API without one. A rollout pod the new operator makes with a token would
    refuse them all (a counted gang restart once every instance did); it gets none until
    the gang's next restart, and an Event says why."""
    w = _world()
    w.step()
    w.run_all()
    w.set("tiny-grpo-trainer-0", phase="Running", pod_ip="10.0.0.1", rollout_token=not old_trainers)
    w.step()
    w.set("tiny-grpo-rollout-0", phase="Failed", exit_code=1)
    made: list[dict[str, Any]] = []
    for _ in range(120):
        d = w.step()
        made += [m for m in d.create if m["metadata"]["name"] == "tiny-grpo-rollout-0"]
        if made:
            break
        w.tick(1)
    assert made, "the failed rollout pod was not made again"
    assert ("RLFT_ROLLOUT_TOKEN" in _env_names(made[0])) is not old_trainers
    assert ("NoRolloutToken" in w.events) is old_trainers
    assert "tiny-grpo-trainer-0" in w.pods  # the trainers go on


def _gang_of_two_stopped(w: World, peer: dict[str, Any]) -> None:
    """A running 2-pod gang whose trainer-0 stopped (exit 1 on purpose, verdict: exit 0,
    stopped; cli/training.py) and whose trainer-1 is as `peer` says."""
    w.step()
    w.run_all()
    w.step()
    stopped = Verdict(ExitCode.OK, stopped=True, last_checkpoint=6)
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1, verdict=stopped)
    w.set("tiny-grpo-trainer-1", **peer)


def test_a_gang_whose_ranks_all_stopped_is_restarted_not_left_waiting():
    """Every rank of a multi-pod gang stopped and none was deleted (the kubelet killed
    one, a failed startup probe, and the others stopped with it): nothing is a failure,
    but nothing runs. The gang stayed Restarting with its Failed pods for good; it is
    restarted, counted, as a single pod that exits 0 early is."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    stopped = Verdict(ExitCode.OK, stopped=True, rank=1, last_checkpoint=6)
    _gang_of_two_stopped(w, dict(phase="Failed", exit_code=1, verdict=stopped))
    d = w.step()
    assert sorted(d.delete_pods) == ["tiny-grpo-trainer-0", "tiny-grpo-trainer-1"]
    assert w.status.restarts == 1 and w.status.phase == "Restarting"
    w.tick(600)
    w.step()
    assert {"tiny-grpo-trainer-0", "tiny-grpo-trainer-1"} <= set(w.created[-2:])


def test_an_elastic_gang_whose_ranks_stopped_is_restarted_though_a_member_has_no_node():
    """replicas 2:3 and trainer-2 never placed (no capacity): the gang was judged only
    once no trainer was active, and a Pending one is, so the stopped gang waited for
    capacity, for good."""
    w = _world(trainer={"replicas": {"min": 2, "max": 3}})
    w.step()
    w.run_all()
    w.set("tiny-grpo-trainer-2", phase="Pending", pod_ip=None)
    w.step()
    for rank in (0, 1):
        stopped = Verdict(ExitCode.OK, stopped=True, rank=rank, last_checkpoint=6)
        w.set(f"tiny-grpo-trainer-{rank}", phase="Failed", exit_code=1, verdict=stopped)
    d = w.step()
    assert {"tiny-grpo-trainer-0", "tiny-grpo-trainer-1"} <= set(d.delete_pods), d.delete_pods
    assert w.status.restarts == 1 and w.status.phase == "Restarting"


def test_a_paused_run_is_suspended_though_a_member_has_no_node():
    """replicas 1:2, trainer-1 never placed, trainer-0's guard paused the run: the job
    showed Running ("training with 1 trainer pods") and kept its rollout pods for good."""
    w = _world(trainer={"replicas": {"min": 1, "max": 2}})
    w.step()
    w.run_all()
    w.set("tiny-grpo-trainer-1", phase="Pending", pod_ip=None)
    w.step()
    paused = Verdict(0, "collapse at step 9 (reward collapse); paused", collapsed=True)
    w.set("tiny-grpo-trainer-0", phase="Succeeded", exit_code=0, verdict=paused)
    d = w.step()
    assert d.set_suspend and w.status.restarts == 0 and d.create == []


def test_peers_stopped_by_a_preempted_rank_wait_for_its_end_and_are_not_counted():
    """The same stops, but the cluster is taking trainer-1 (preempted, still ending): its
    end explains them, a disruption not counted against restartPolicy."""
    w = _world(trainer={"replicas": {"min": 2, "max": 2}})
    taken = dict(phase="Running", pod_ip="10.0.0.1", disruption="PreemptionByScheduler")
    _gang_of_two_stopped(w, dict(taken, deleting=True))
    d = w.step()
    assert d.delete_pods == [] and w.status.restarts == 0
    w.set("tiny-grpo-trainer-1", **dict(taken, phase="Failed", exit_code=143, deleting=True))
    d = w.step()
    assert w.status.last_failure.reason == "Preempted" and w.status.restart_history == []


def test_a_new_leader_finishes_an_instance_restart_its_predecessor_began():
    """The operator wrote the status of a multi-node instance's restart (its head and
    worker counted) and died before its deletes: the next one deleted only the failed
    worker, and the head, its engine broken, kept serving to the replacement."""
    w = _world(rollout={"engine": "vllm", "nodesPerInstance": 2})
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-rollout-0-worker-1", phase="Failed", exit_code=1)
    job, body = parsed(job_doc(**copy.deepcopy(w.spec)))
    observed = Observed(
        pods=list(w.pods.values()),
        config_maps=frozenset(w.other),
        services=frozenset(w.other),
        config_data=dict(w.config),
    )
    first = reconcile(job, body, w.status, observed, w.now)
    instance = ["tiny-grpo-rollout-0-head", "tiny-grpo-rollout-0-worker-1"]
    assert sorted(first.delete_pods) == instance
    again = reconcile(job, body, first.status, observed, w.now + timedelta(seconds=30))
    assert sorted(again.delete_pods) == instance and again.status.restarts == 1


def _running_pair_without_restarts() -> World:
    """A running 2-pod gang whose restartPolicy allows none."""
    w = _world(
        trainer={"replicas": {"min": 2, "max": 2}},
        restartPolicy={**RESTARTS, "maxRestarts": 0},
    )
    w.step()
    w.run_all()
    w.step()
    return w


@pytest.mark.parametrize(
    "meanwhile",
    ["peer gone", "rank 0 being deleted", "rollout failed"],
)
def test_what_happens_after_rank_0_finished_does_not_undo_the_success(meanwhile):
    """Rank 0 reported the job complete, and before the operator saw it: trainer-1's pod
    vanished (its node lost, collected), a drain began deleting rank 0's pod, or a rollout
    server failed in its teardown. Each was judged as a failure of the running job: a
    counted gang restart that ran the finished job again, or a Failed job."""
    w = _running_pair_without_restarts()
    done = Verdict(0, completed=True, step=12, last_checkpoint=12, checkpoint_uri="s3://b/r/s")
    finished = dict(phase="Succeeded", exit_code=0, verdict=done)
    if meanwhile == "rank 0 being deleted":
        finished |= dict(deleting=True, disruption="EvictionByEvictionAPI")
    w.set("tiny-grpo-trainer-0", **finished)
    if meanwhile == "peer gone":
        w.pods.pop("tiny-grpo-trainer-1")
    if meanwhile == "rollout failed":
        w.set("tiny-grpo-rollout-0", phase="Failed", exit_code=1)
    d = w.step()
    assert w.status.phase == "Succeeded", w.status.message
    assert w.status.restarts == 0 and w.status.step == 12
    assert not any(m["kind"] == "Pod" for m in d.create)
    assert w.step().create == []


def test_a_vanished_trainer_that_fails_the_job_ends_it_in_the_same_round():
    """maxRestarts 0 and trainer-1's pod vanished: the job fails, and that round created
    a replacement pod and left trainer-0 running (nothing is made once a job failed)."""
    w = _running_pair_without_restarts()
    w.pods.pop("tiny-grpo-trainer-1")
    d = w.step()
    assert w.status.phase == "Failed"
    assert sorted(d.delete_pods) == ["tiny-grpo-rollout-0", "tiny-grpo-trainer-0"]


def test_trainers_stopped_early_that_fail_the_job_are_freed_in_the_same_round():
    w = _world(restartPolicy={**RESTARTS, "maxRestarts": 0})
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-0", phase="Succeeded", exit_code=0, verdict=Verdict(0))
    d = w.step()
    assert w.status.phase == "Failed" and d.delete_pods == ["tiny-grpo-rollout-0"]


def test_the_status_message_of_a_large_gang_fits_the_crd():
    """A 64-pod gang waits for its running peers' verdicts after one failed: the message
    named every peer, 1,440 characters, and the API server refused the status write (the
    CRD's maxLength is 1024) until the wait ended."""
    w = _world(trainer={"replicas": {"min": 64, "max": 64}})
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-7", phase="Failed", exit_code=1, finished_at=w.now.isoformat())
    d = w.step()
    assert (
        "waiting for tiny-grpo-trainer-0, tiny-grpo-trainer-1, tiny-grpo-trainer-10 and 60 more"
        in (d.status.message)
    )
    RLFineTuneStatus.model_validate(d.status.model_dump(mode="json", by_alias=True))


def test_a_restart_backoff_longer_than_the_scheduling_timeout_is_not_unschedulable():
    """The 7th restart in a window waits 640 s by default, past the 600 s scheduling
    timeout: the gang was declared unschedulable during the backoff, before its pods
    existed (a Warning, Scheduled=False). The wait for nodes begins with the pods."""
    w = _world(
        restartPolicy={**RESTARTS, "backoffSeconds": 400},
        scheduling={"schedulingTimeoutSeconds": 300},
    )
    w.step()
    w.run_all()
    w.step()
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1, finished_at=w.now.isoformat())
    w.step()
    for _ in range(5):
        w.tick(100)
        w.step()  # the pod is made again at 400 s, then waits 100 s for a node
    assert "tiny-grpo-trainer-0" in w.pods and w.pods["tiny-grpo-trainer-0"].phase == "Pending"
    assert "Unschedulable" not in w.events
    assert _condition(w, "Scheduled")[0] != "False"
    w.tick(250)  # 350 s since the pod was made: now it is unschedulable
    w.step()
    assert "Unschedulable" in w.events


def test_a_gang_kueue_has_not_admitted_is_queued_not_unschedulable() -> None:
    """Kueue gates the pods until it admits the gang, and the API server marks each
    gated pod PodScheduled=False, reason SchedulingGated: past schedulingTimeoutSeconds
    that is a queue (Scheduled False, reason Queued, a Normal Event), not a Warning that
    the pods cannot be placed."""
    w = _world(scheduling={"schedulingTimeoutSeconds": 60})
    w.step()
    gated = copy.deepcopy(raw_pod("tiny-grpo-trainer-0"))
    gated["spec"] = {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}
    gated["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated",
         "message": "Scheduling is blocked due to non-empty scheduling gates"},
    ]  # fmt: skip
    held = pod_view(gated)
    assert held.gated and not held.unschedulable
    w.pods = {
        name: replace(pod, unschedulable="", gated=pod.role == N.ROLE_TRAINER)
        for name, pod in w.pods.items()
    }
    w.step()
    assert _condition(w, "Scheduled") == ("False", "Queued")
    queued = w.status.model_dump()
    w.tick(3600)  # queued for an hour: the same status, no Unschedulable
    w.step()
    assert w.status.model_dump() == queued
    assert w.events.count("Queued") == 1 and "Unschedulable" not in w.events
    # Admitted, the gang gets its whole schedulingTimeoutSeconds to be placed.
    w.pods = {name: replace(pod, gated=False) for name, pod in w.pods.items()}
    w.step()
    w.tick(30)
    w.step()
    assert _condition(w, "Scheduled") == ("Unknown", "Waiting")


def test_a_gang_waiting_for_its_predecessor_to_stop_is_not_unschedulable() -> None:
    """trainer-1 fails and the gang restarts; trainer-0 takes its grace period to stop
    (an emergency checkpoint), longer than schedulingTimeoutSeconds. The new trainer-0
    cannot be made before the old one is gone (its name): no Unschedulable meanwhile,
    and the timeout counts from when the old pod left."""
    w = _world(
        trainer={"replicas": {"min": 2, "max": 2}}, scheduling={"schedulingTimeoutSeconds": 60}
    )
    w.step()
    w.run_all()
    w.step()
    old = w.pods["tiny-grpo-trainer-0"]
    w.set("tiny-grpo-trainer-1", phase="Failed", exit_code=1)
    d = w.step()
    assert "tiny-grpo-trainer-0" in d.delete_pods
    grace_ends = (w.now + timedelta(seconds=300)).strftime("%Y-%m-%dT%H:%M:%SZ")
    w.pods["tiny-grpo-trainer-0"] = view(
        old.name, old.role, old.index, uid=old.uid, created=old.created,
        phase="Running", deleting=True, grace_ends=grace_ends,
    )  # fmt: skip
    w.tick(10)
    w.step()
    settled = w.status.model_dump()
    for _ in range(20):  # 200 s of its grace
        w.tick(10)
        w.step()
        assert _condition(w, "Scheduled") == ("Unknown", "Waiting")
        # Nothing in the status moves while it waits: each write is an event that
        # starts another reconcile (a status that changed each time was rewritten
        # as fast as the API server answered).
        assert w.status.model_dump() == settled
    assert "Unschedulable" not in w.events
    del w.pods["tiny-grpo-trainer-0"]  # stopped: the new gang is made and waits
    w.step()
    w.tick(30)
    w.step()
    assert _condition(w, "Scheduled") == ("Unknown", "Waiting")
    w.tick(31)
    w.step()
    assert _condition(w, "Scheduled") == ("False", "Unschedulable")
