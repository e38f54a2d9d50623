"""Edits of a job's spec (operator/spec_changes.py) and refused creates
(operator/creation.py), through the pure planner: what is applied when, the ConfigMap
re-rendered, the trainer gang restarted for new replicas, observedGeneration moving only
once an edit is applied, and creates backing off after a refusal."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import yaml
from crd_validation import validate
from jobs import job_doc
from test_operator_reconcile import T0, World, _world

from rlft.operator import crd
from rlft.operator import creation as C
from rlft.operator import spec_changes as S
from rlft.operator.status import CreateFailure, RLFineTuneStatus, rfc3339

CM = "tiny-grpo-config"


def _job_file(w: World) -> dict[str, Any]:
    return yaml.safe_load(w.config[CM])


def _running(**spec: Any) -> World:
    w = _world(**spec)
    w.step()
    w.run_all()
    w.step()
    assert w.status.phase == "Running" and w.status.observed_generation == 1
    return w


def _condition(w: World, kind: str) -> Any:
    return next((c for c in w.status.conditions if c.type == kind), None)


def _nnodes(d: Any) -> set[str]:
    return {
        arg
        for m in d.create
        if m["kind"] == "Pod" and "trainer" in m["metadata"]["name"]
        for arg in m["spec"]["containers"][0]["command"]
        if arg.startswith("--nnodes=")
    }


def _trainer(**fields: Any) -> dict[str, Any]:
    return {"trainer": fields}


# ------------------------------------------------------------- edits while suspended


def test_an_edit_while_suspended_is_applied_and_the_resume_runs_it():
    w = _running()
    w.edit(suspend=True)
    d = w.step()
    assert w.status.phase == "Suspended" and sorted(d.delete_pods) == [
        "tiny-grpo-rollout-0",
        "tiny-grpo-trainer-0",
    ]
    assert _job_file(w)["spec"]["suspend"] is True  # live: re-rendered whenever it changes
    assert w.status.observed_generation == 2
    w.edit(suspend=True, **_trainer(steps=600, learningRate=1e-4, image="registry/trainer:2"))
    d = w.step()
    (cm,) = d.update  # no pod reads the job file now: re-rendered at once
    assert cm["metadata"]["name"] == CM and d.create == []
    trainer = _job_file(w)["spec"]["trainer"]
    assert (trainer["steps"], trainer["learningRate"]) == (600, 1e-4)
    assert w.status.observed_generation == 3
    w.edit(suspend=False, **_trainer(steps=600, learningRate=1e-4, image="registry/trainer:2"))
    d = w.step()
    assert _job_file(w)["spec"]["suspend"] is False  # re-rendered before the pods start
    pod = next(m for m in d.create if m["metadata"]["name"] == "tiny-grpo-trainer-0")
    assert pod["spec"]["containers"][0]["image"] == "registry/trainer:2"  # from the new spec
    assert w.status.observed_generation == 4 and w.status.phase == "Pending"


def test_an_edit_made_with_the_resume_re_renders_before_the_pods_are_created():
    w = _running()
    w.edit(suspend=True)
    w.step()
    w.edit(suspend=False, rollout={"sampling": {"temperature": 0.7, "maxNewTokens": 6}})
    d = w.step()
    assert [m["metadata"]["name"] for m in d.update] == [CM]
    assert {m["metadata"]["name"] for m in d.create} == {
        "tiny-grpo-tokens-0f0e-uid",
        "tiny-grpo-ingress-0f0e-uid",
        "tiny-grpo-trainer-0",
        "tiny-grpo-rollout-0",
    }
    assert _job_file(w)["spec"]["rollout"]["sampling"]["temperature"] == 0.7
    assert w.status.observed_generation == 3


def test_the_config_map_is_re_rendered_while_the_suspended_pods_terminate():
    """Pods being deleted read no job file any more: the edit need not wait for them."""
    w = _running()
    w.edit(suspend=True, **_trainer(steps=42))
    d = w.step()
    assert d.delete_pods and [m["metadata"]["name"] for m in d.update] == [CM]
    assert _job_file(w)["spec"]["trainer"]["steps"] == 42


# ------------------------------------------------------------- edits while running


def test_an_edit_that_reaches_a_running_job_waits_for_a_suspend():
    """The CRD refuses it; it can still arrive (a CRD without the rule, a race). The pods
    keep the job file they started with: observedGeneration stays, SpecApplied=False names
    the field, with one Event; a suspend then applies it."""
    w = _running()
    w.edit(**_trainer(learningRate=1e-4))
    d = w.step()
    assert d.update == [] and d.delete_pods == [] and w.status.observed_generation == 1
    applied = _condition(w, "SpecApplied")
    assert (applied.status, applied.reason) == ("False", "SuspendToApply")
    assert "spec.trainer.learningRate" in applied.message and "suspend" in applied.message
    w.step()
    assert w.events.count("SuspendToApply") == 1
    w.edit(suspend=True, **_trainer(learningRate=1e-4))
    d = w.step()
    assert [m["metadata"]["name"] for m in d.update] == [CM]
    assert w.status.observed_generation == 3
    assert _condition(w, "SpecApplied").status == "True"


def test_replacement_pods_of_a_job_whose_edit_waits_run_the_spec_it_runs():
    """While an edit waits for a suspend, a failed trainer is replaced by a pod of the
    job as its running pods have it (image, command), and no slot of it goes: the edit
    used to reach every new pod (a new image reading the old job file), and lowering
    rollout.instances deleted an instance the trainers still send to."""
    w = _running(rollout={"instances": 2})
    w.edit(**_trainer(image="registry/trainer:NEW"), rollout={"instances": 1})
    d = w.step()
    assert d.delete_pods == [] and d.update == []
    assert _condition(w, "SpecApplied").reason == "SuspendToApply"
    w.set("tiny-grpo-trainer-0", phase="Failed", exit_code=1)
    decisions = [w.step()]
    w.tick(3600)
    decisions += [w.step() for _ in range(3)]
    created = [m for d in decisions for m in d.create if m["kind"] == "Pod"]
    assert created, "the failed trainer was not replaced"
    images = {c["image"] for m in created for c in m["spec"]["containers"]}
    assert "registry/trainer:NEW" not in images, images
    deleted = [name for d in decisions for name in d.delete_pods]
    assert not [name for name in deleted if "rollout" in name], deleted


def test_an_edit_of_live_fields_is_applied_at_once():
    w = _running()
    w.edit(restartPolicy={"maxRestarts": 7, "windowMinutes": 60, "backoffSeconds": 10})
    d = w.step()
    assert [m["metadata"]["name"] for m in d.update] == [CM]  # the trainer ignores it
    assert d.delete_pods == [] and w.status.observed_generation == 2
    assert _job_file(w)["spec"]["restartPolicy"]["maxRestarts"] == 7
    assert _condition(w, "SpecApplied") is None  # nothing ever waited


@pytest.mark.parametrize(
    ("before", "after"), [((1, 2), (1, 4)), ((1, 3), (1, 2)), ((2, 2), (1, 2))]
)
def test_new_replicas_restart_the_trainer_gang_with_the_new_nnodes(before, after):
    """--nnodes=min:max is in every agent's command and each agent judges the rendezvous
    by its own: the whole gang restarts (a rendezvous of its own), not counted as a
    failure; the rollout pods stay; observedGeneration moves once the new gang exists."""
    lo, hi = before
    w = _running(trainer={"replicas": {"min": lo, "max": hi}})
    assert w.status.gang_replicas == f"{lo}:{hi}"
    attempt = w.status.gang_attempt
    w.edit(trainer={"replicas": {"min": after[0], "max": after[1]}})
    d = w.step()
    assert sorted(d.delete_pods) == [f"tiny-grpo-trainer-{i}" for i in range(hi)]
    assert "tiny-grpo-rollout-0" in w.pods and "Rescaling" in w.events
    assert w.status.restarts == 0 and w.status.restart_history == []
    assert w.status.gang_attempt == attempt + 1 and w.status.phase == "Restarting"
    # Deliberate: said as a rescale, not warned as a gang that fell below replicas.min.
    assert "Restarting" not in w.events and "with replicas" in w.status.message
    nnodes = _nnodes(d)  # new slots at once; the old ones once their pods are gone
    assert w.status.observed_generation == (2 if nnodes else 1)
    if not nnodes:
        assert _condition(w, "SpecApplied").reason == "Rescaling"
    d = w.step()
    assert nnodes | _nnodes(d) == {f"--nnodes={after[0]}:{after[1]}"}
    trainers = sorted(n for n in w.pods if "trainer" in n)
    assert trainers == [f"tiny-grpo-trainer-{i}" for i in range(after[1])]
    assert w.status.observed_generation == 2 and w.status.gang_replicas == f"{after[0]}:{after[1]}"
    assert _condition(w, "SpecApplied") is None or _condition(w, "SpecApplied").status == "True"
    w.run_all()
    w.step()
    assert w.status.phase == "Running" and w.status.restarts == 0


def test_a_rescale_waits_for_the_old_gang_to_terminate():
    w = _running(trainer={"replicas": {"min": 1, "max": 2}})
    w.edit(trainer={"replicas": {"min": 1, "max": 3}})
    deleting = {n: p for n, p in w.pods.items() if "trainer" in n}
    d = w.step()
    created = [m["metadata"]["name"] for m in d.create]
    assert created == [
        "tiny-grpo-tokens-0f0e-uid",
        "tiny-grpo-ingress-0f0e-uid",
        "tiny-grpo-trainer-2",
    ]
    assert _nnodes(d) == {"--nnodes=1:3"}
    assert w.status.observed_generation == 2  # every trainer pod is made from the spec now
    for name, pod in deleting.items():  # still Terminating (their emergency checkpoint)
        w.pods[name] = pod
        w.set(name, phase="Running", deleting=True)
    d = w.step()
    assert d.delete_pods == [] and d.create == [] and w.events.count("Rescaling") == 1
    for name in deleting:
        w.pods.pop(name)
    d = w.step()
    assert sorted(m["metadata"]["name"] for m in d.create) == [
        "tiny-grpo-ingress-0f0e-uid",
        "tiny-grpo-tokens-0f0e-uid",
        "tiny-grpo-trainer-0",
        "tiny-grpo-trainer-1",
    ]
    assert _nnodes(d) == {"--nnodes=1:3"} and w.status.restarts == 0


def test_replicas_edited_while_suspended_need_no_extra_restart():
    w = _running(trainer={"replicas": {"min": 1, "max": 2}})
    w.edit(suspend=True, trainer={"replicas": {"min": 1, "max": 2}})
    w.step()
    w.edit(suspend=False, trainer={"replicas": {"min": 2, "max": 4}})
    d = w.step()
    assert _nnodes(d) == {"--nnodes=2:4"} and "Rescaling" not in w.events
    assert w.status.observed_generation == 3


@pytest.mark.parametrize("ended", ["completed", "paused"])
def test_a_replicas_edit_seen_with_rank_0_ended_restarts_nothing(ended):
    """The edit and rank 0's end met in one reconcile (a leader failover): the rescale
    deleted the gang, the completed pod too, and made it again (or turned the collapse
    pause into a restart, never suspending the job)."""
    from rlft.trainer.termination import Verdict

    w = _running(trainer={"replicas": {"min": 1, "max": 2}})
    verdict = Verdict(0, completed=ended == "completed", collapsed=ended == "paused", step=12)
    w.set("tiny-grpo-trainer-0", phase="Succeeded", exit_code=0, verdict=verdict)
    w.set("tiny-grpo-trainer-1", phase="Succeeded", exit_code=0, verdict=Verdict(0, rank=1))
    w.edit(trainer={"replicas": {"min": 1, "max": 3}})
    d = w.step()
    assert "tiny-grpo-trainer-0" not in d.delete_pods and "Rescaling" not in w.events
    if ended == "completed":
        assert w.status.phase == "Succeeded"
    else:  # suspended: the operator asks for spec.suspend, restarting nothing
        assert d.set_suspend and w.status.restarts == 0 and d.create == []


def test_a_finished_job_never_applies_an_edit():
    w = _running()
    w.edit(**_trainer(steps=900))
    w.status.phase = "Succeeded"
    d = w.step()
    assert d.create == [] and d.update == [] and w.status.observed_generation == 1


# ------------------------------------------------------------- the job file's diff


def test_frozen_changes_name_the_fields_and_skip_the_live_ones():
    old = {"spec": {"trainer": {"steps": 1, "replicas": {"max": 2}}, "suspend": False}}
    new = {"spec": {"trainer": {"steps": 2, "replicas": {"max": 4}}, "suspend": True}}
    assert S.frozen_changes(old, new) == ["spec.trainer.steps"]
    assert S.frozen_changes(old, {"spec": {**old["spec"], "restartPolicy": {"x": 1}}}) == []
    assert S.config_change(yaml.safe_dump(old), yaml.safe_dump(new), True).waiting == (
        "spec.trainer.steps",
    )
    assert S.config_change(yaml.safe_dump(old), yaml.safe_dump(new), False).update
    assert S.config_change(None, yaml.safe_dump(new), True) == S.ConfigChange()


def test_every_spec_field_is_live_identity_or_frozen_while_running():
    frozen = set(S.frozen_while_running())
    assert "trainer.learningRate" in frozen and "rollout" in frozen
    assert not frozen & {"suspend", "restartPolicy", "trainer.replicas", "trainer", "model"}


# ------------------------------------------------------------- refused creates


def _refusal(name: str = "tiny-grpo-rollout-0", code: int = 403) -> C.Refusal:
    message = (
        f'pods "{name}" is forbidden: exceeded quota: gpus, requested: pods=1, '
        "used: pods=1, limited: pods=1"
    )
    return C.Refusal("create", "Pod", name, code, message)


def test_a_refused_create_is_a_condition_one_event_and_a_doubling_wait():
    st = RLFineTuneStatus(phase="Pending")
    waits, events = [], []
    now = T0
    for _ in range(4):
        st, event = C.after_writes(st, _refusal(), True, 1, now)
        events.append(event)
        waits.append(C.hold_seconds(st, 1, now))
        now += timedelta(seconds=1)
    assert waits == [2, 4, 8, 16]
    assert [e is not None for e in events] == [True, False, False, False]
    assert events[0][:2] == ("Warning", "QuotaExceeded") and "exceeded quota" in events[0][2]
    created = next(c for c in st.conditions if c.type == "Created")
    assert (created.status, created.reason) == ("False", "QuotaExceeded")
    assert st.create_failure.attempts == 4 and "limited: pods=1" in created.message
    assert C.hold_seconds(st, 2, now) is None  # an edit is tried at once
    _, other = C.after_writes(st, _refusal("tiny-grpo-trainer-1"), True, 1, now)
    assert other is not None  # another child: a distinct refusal, another Event
    st, event = C.after_writes(st, None, True, 1, now)
    assert st.create_failure is None and event[:2] == ("Normal", "Created")
    assert next(c for c in st.conditions if c.type == "Created").status == "True"
    assert C.after_writes(st, None, True, 1, now) is None
    # The round whose writes succeeded lost its status write (a conflict): a later round
    # with nothing to write clears it once the wait is over, not while it lasts.
    lost, _ = C.after_writes(RLFineTuneStatus(), _refusal(), True, 1, now)
    assert C.after_writes(lost, None, False, 1, now) is None
    cleared, event = C.after_writes(lost, None, False, 1, now + timedelta(seconds=2))
    assert cleared.create_failure is None and event[:2] == ("Normal", "Created")


@pytest.mark.parametrize(
    ("code", "message", "reason"),
    [
        (403, 'pods "p" is forbidden: exceeded quota: q, requested: …', "QuotaExceeded"),
        (403, 'pods "p" is forbidden: violates PodSecurity "restricted:latest": …', "Forbidden"),
        (422, 'Pod "p" is invalid: spec.containers[0].image: Required value', "Invalid"),
        (400, "the object has no metadata", "BadRequest"),
    ],
)
def test_refusal_reasons(code, message, reason):
    assert C.reason(code, message) == reason


def test_the_wait_is_capped_and_the_message_too():
    assert C.backoff_seconds(30) == C.MAX_BACKOFF_SECONDS
    long = C.Refusal("create", "Pod", "p", 422, "x" * 5000)
    st, _ = C.after_writes(RLFineTuneStatus(), long, True, 1, T0)
    assert len(st.create_failure.message) == C.MESSAGE_LIMIT
    RLFineTuneStatus.model_validate(st.model_dump(by_alias=True))  # within the CRD's bounds


def test_the_planner_creates_nothing_while_a_refusal_waits():
    w = _world()
    w.step()
    w.pods.pop("tiny-grpo-rollout-0")  # refused: never created
    w.status.create_failure = CreateFailure(
        kind="Pod",
        name="tiny-grpo-rollout-0",
        reason="QuotaExceeded",
        code=403,
        retry_at=rfc3339(w.now + timedelta(seconds=4)),
        generation=1,
    )
    d = w.step()
    assert d.create == [] and d.requeue_after == pytest.approx(4)
    w.tick(4)
    d = w.step()
    assert [m["metadata"]["name"] for m in d.create] == [
        "tiny-grpo-tokens-0f0e-uid",
        "tiny-grpo-ingress-0f0e-uid",
        "tiny-grpo-rollout-0",
    ]


# ------------------------------------------------------------- admission (CEL)

SCHEMA = crd.crd_schema()


def _stored(phase: str | None, suspend: bool = False) -> dict[str, Any]:
    doc = job_doc()
    doc["spec"]["suspend"] = suspend
    return {**doc, "status": {"phase": phase}} if phase else doc


def _edited(old: dict[str, Any], change: Any) -> dict[str, Any]:
    new = copy.deepcopy(old)
    change(new["spec"])
    return new


FROZEN_EDITS = {
    "learningRate": (lambda s: s["trainer"].update(learningRate=1e-4), "spec.trainer.learningRate"),
    "steps": (lambda s: s["trainer"].update(steps=900), "spec.trainer.steps"),
    "image": (lambda s: s["trainer"].update(image="registry/trainer:2"), "spec.trainer.image"),
    "temperature": (lambda s: s["rollout"]["sampling"].update(temperature=0.5), "spec.rollout"),
    "nodeSelector": (
        lambda s: s.update(scheduling={"nodeSelector": {"gpu": "h100"}}),
        "spec.scheduling",
    ),
    "eval": (lambda s: s.pop("eval"), "spec.eval"),
}


@pytest.mark.parametrize("edit", list(FROZEN_EDITS))
@pytest.mark.parametrize("phase", ["Pending", "Running", "Restarting", "Suspended"])
def test_an_edit_a_running_job_cannot_take_is_refused_naming_the_field(edit, phase):
    """`Suspended` with spec.suspend false: a resume under way (its pods may be being
    created from the spec the operator read), so it counts as running."""
    change, field = FROZEN_EDITS[edit]
    old = _stored(phase)
    _, problems, _ = validate(_edited(old, change), SCHEMA, old)
    assert [p.field for p in problems] == [field], problems
    assert "cannot change while the job runs: suspend it first" in problems[0].message


@pytest.mark.parametrize("edit", list(FROZEN_EDITS))
@pytest.mark.parametrize(
    ("phase", "suspend"),
    [
        ("Running", True),
        ("Suspended", True),
        (None, False),
        ("Succeeded", False),
        ("Failed", False),
    ],
)
def test_the_same_edit_is_accepted_once_suspend_is_asked_or_before_the_job_started(
    edit, phase, suspend
):
    change, _ = FROZEN_EDITS[edit]
    old = _stored(phase, suspend)
    assert validate(_edited(old, change), SCHEMA, old)[1] == []


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["trainer"].update(replicas={"min": 1, "max": 4}),
        lambda s: s["trainer"].update(replicas={"min": 2, "max": 2}),
        lambda s: s.update(restartPolicy={"maxRestarts": 1, "backoffSeconds": 5}),
        lambda s: s.update(suspend=True),
    ],
)
def test_live_fields_change_while_the_job_runs(change):
    old = _stored("Running")
    assert validate(_edited(old, change), SCHEMA, old)[1] == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["model"]["init"].update(hiddenSize=256), "spec.model"),
        (lambda s: s["algorithm"].update(name="rloo"), "spec.algorithm.name"),
        (
            lambda s: s["data"].update(source="jsonl", jsonl={"train": "t.jsonl"}),
            "spec.data.source",
        ),
        (lambda s: s["checkpoint"].update(uri="s3://elsewhere/run"), "spec.checkpoint.uri"),
    ],
)
def test_identity_fields_never_change_once_the_job_started(change, field):
    for phase, suspend in (("Suspended", True), ("Succeeded", False)):
        old = _stored(phase, suspend)
        _, problems, _ = validate(_edited(old, change), SCHEMA, old)
        assert [p.field for p in problems] == [field], problems
        assert "cannot change once the job has started" in problems[0].message
        assert "create a new job" in problems[0].message
    old = _stored(None)
    assert validate(_edited(old, change), SCHEMA, old)[1] == []


def test_a_job_file_from_an_older_operator_is_no_edit_for_the_fields_added_since():
    # The ConfigMap of a running job, as the operator before telemetry.expertLoadEverySteps
    # wrote it: the field absent. Read raw, this operator's file differed there, and the
    # job waited for a suspend (replicas edits ignored meanwhile) for a field nobody set.
    w = _running()
    older = _job_file(w)
    del older["spec"]["telemetry"]["expertLoadEverySteps"]
    now = w.config[CM]
    change = S.config_change(yaml.safe_dump(older), now, pods_active=True)
    assert change == S.ConfigChange(update=True), change
    w.config[CM] = yaml.safe_dump(older)
    d = w.step()  # the reconcile of the upgraded operator: rewrites it, nothing waits
    assert w.status.phase == "Running" and not d.delete_pods, d
    assert [u["metadata"]["name"] for u in d.update] == [CM], d.update
    assert not any(e.reason == "SuspendToApply" for e in d.events), d.events
    # A value the user did set is still an edit that waits.
    edited = yaml.safe_load(now)
    edited["spec"]["telemetry"]["expertLoadEverySteps"] = 7
    waiting = S.config_change(yaml.safe_dump(older), yaml.safe_dump(edited), pods_active=True)
    assert waiting.waiting == ("spec.telemetry.expertLoadEverySteps",), waiting
