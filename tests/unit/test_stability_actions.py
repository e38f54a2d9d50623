"""The action policy (exhaustively over its inputs) and the StepGuard the loop uses."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
from pydantic import ValidationError

from rlft.trainer.config import JobFileError, parse_job
from rlft.trainer.config.stability import StabilitySpec
from rlft.trainer.stability.actions import Counters, GuardDecision, StepGuard, decide
from rlft.trainer.stability.detector import CHECKS, CRITICAL, OK, WARNING, Verdict


def verdict(**levels: int) -> Verdict:
    return Verdict(step=7, levels={**dict.fromkeys(CHECKS, OK), **levels})


VERDICTS = {
    "ok": verdict(),
    "warning": verdict(entropy_collapse=WARNING, grad_norm_spike=WARNING),
    "spike": verdict(grad_norm_spike=CRITICAL),
    "nan": verdict(non_finite=CRITICAL),
    "collapse": verdict(reward_collapse=CRITICAL),
    "spike+collapse": verdict(grad_norm_spike=CRITICAL, sustained_spikes=CRITICAL),
}


@pytest.mark.parametrize(
    ("on_collapse", "on_spike", "after_max", "rollbacks", "kind"),
    list(
        itertools.product(
            ["rollback", "suspend", "fail", "alert"],
            ["skip", "alert"],
            ["suspend", "fail"],
            [0, 2, 3],
            list(VERDICTS),
        )
    ),
)
def test_decide_covers_every_combination(on_collapse, on_spike, after_max, rollbacks, kind):
    spec = StabilitySpec(
        on_collapse=on_collapse, on_spike=on_spike, after_max_rollbacks=after_max, max_rollbacks=3
    )
    v = VERDICTS[kind]
    action, note = decide(v, spec, Counters(skipped=5, rollbacks=rollbacks))
    if v.collapsed and on_collapse != "alert":
        expected = {"suspend": "pause", "fail": "fail"}.get(on_collapse)
        if on_collapse == "rollback":
            if rollbacks < 3:
                expected = "rollback"
            else:
                expected = "pause" if after_max == "suspend" else "fail"
                assert "maxRollbacks" in note
        assert action == expected
    elif v.skip_update and (on_spike == "skip" or kind == "nan"):
        assert action == "skip"
    else:
        assert action == "apply"
    # A critical update is never applied unless the user asked for alerts only, and a
    # non-finite one never (it made every weight NaN with onSpike: alert).
    if v.skip_update and action == "apply":
        assert on_spike == "alert" and kind != "nan"


def records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"step": s, "grad_norm": math.exp(rng.gauss(0, 0.2)), "entropy": 0.3, "reward_mean": 0.5}
        for s in range(1, n + 1)
    ]


class Recorder:
    def __init__(self):
        self.calls: list[tuple[GuardDecision, Counters]] = []

    def on_decision(self, decision: GuardDecision, counters: Counters) -> None:
        self.calls.append((decision, counters))


def test_guard_skips_a_spike_and_counts_it():
    listener = Recorder()
    guard = StepGuard(StabilitySpec(), listener=listener)
    stream = records(40)
    stream[30]["grad_norm"] *= 100
    decisions = [guard.check(r) for r in stream]
    assert [d.action for d in decisions].count("skip") == 1
    assert decisions[30].action == "skip" and decisions[30].health == "warning"
    assert guard.counters == Counters(skipped=1, rollbacks=0)
    assert len(listener.calls) == 40 and listener.calls[30][1].skipped == 1
    assert not guard.healthy_for_checkpoint()  # trouble in the last window
    # Healthy again exactly once a whole sustained window of clean steps followed the
    # last warning: not a step earlier, not a step later.
    window = guard.spec.detector.sustained.window
    last_trouble = max(i for i, d in enumerate(decisions) if d.level >= WARNING)
    clean = len(decisions) - 1 - last_trouble
    assert 0 < clean < window
    for r in records(20, seed=1):
        decision = guard.check({**r, "step": r["step"] + 40})
        assert decision.level < WARNING
        clean += 1
        assert guard.healthy_for_checkpoint() == (clean >= window), clean
    assert guard.healthy_for_checkpoint()


def test_guard_rolls_back_with_window_and_lr_then_fails_after_max_rollbacks():
    spec = StabilitySpec(max_rollbacks=2, rollback_lr_scale=0.5)
    guard = StepGuard(spec)
    stream = records(40)
    for r in stream:
        guard.check(r)
    saved = json.loads(json.dumps(guard.detector.state_dict()))
    assert guard.healthy_for_checkpoint()

    def blow_up(first_step: int) -> GuardDecision:
        decision = None
        for i in range(3):
            decision = guard.check(
                {"step": first_step + i * 2, "grad_norm": 1e3, "entropy": 0.3, "reward_mean": 0.5}
            )
        return decision

    first = blow_up(41)
    assert first.action == "rollback" and first.health == "collapsed"
    assert first.restore_before_step == 41 and first.resume_data_after_step == 45
    # counted once made (a rollback that finds no checkpoint ends the run instead)
    assert first.lr_multiplier == 0.5 and guard.counters.rollbacks == 0
    guard.rolled_back()
    assert guard.lr_multiplier == 0.5 and guard.counters.rollbacks == 1
    guard.restore_detector(saved)
    # the restored checkpoint was healthy: the trouble before it is forgotten, and the
    # next rollback goes back to before its own trouble, not the first one's
    assert guard.healthy_for_checkpoint()
    second = blow_up(46)
    assert second.action == "rollback" and second.lr_multiplier == 0.25
    assert second.restore_before_step == 46 and second.resume_data_after_step == 50
    guard.rolled_back()
    assert guard.lr_multiplier == 0.25
    guard.restore_detector(saved)
    third = blow_up(51)
    assert third.action == "fail" and "maxRollbacks" in third.reasons[-1]
    assert guard.counters.rollbacks == 2 and guard.counters.skipped == 6


def test_rollback_without_skipping_data():
    guard = StepGuard(StabilitySpec(skip_data_window=False))
    for r in records(30):
        guard.check(r)
    for step in (31, 32, 33):
        decision = guard.check({"step": step, "grad_norm": math.nan})
    assert decision.action == "rollback" and decision.resume_data_after_step is None


def test_guard_state_round_trip_keeps_counters():
    guard = StepGuard()
    stream = records(50)
    stream[40]["grad_norm"] = math.inf
    for r in stream:
        guard.check(r)
    other = StepGuard()
    other.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert other.counters == guard.counters == Counters(skipped=1, rollbacks=0)
    nxt = {"step": 51, "grad_norm": 1.0, "entropy": 0.3, "reward_mean": 0.5}
    assert other.check(dict(nxt)).verdict.to_dict() == guard.check(dict(nxt)).verdict.to_dict()
    # The trouble at step 41 and the clean steps since travel too: the resumed guard
    # turns healthy for checkpoints at the very step the original does.
    window = guard.spec.detector.sustained.window
    healthy = []
    for r in records(window, seed=2):
        step = {**r, "step": r["step"] + 51}
        assert other.check(dict(step)).level == guard.check(dict(step)).level < WARNING
        healthy.append((other.healthy_for_checkpoint(), guard.healthy_for_checkpoint()))
    assert [mine for mine, _ in healthy] == [theirs for _, theirs in healthy]
    assert healthy[0] == (False, False) and healthy[-1] == (True, True)


def test_stability_section_in_a_job_file(tmp_path):
    document = {
        "apiVersion": "rlft.dev/v1alpha1",
        "kind": "RLFineTune",
        "metadata": {"name": "j"},
        "spec": {
            "model": {"init": {}},
            "stability": {"onSpike": "alert", "detector": {"gradNorm": {"criticalZ": 8.0}}},
        },
    }
    job = parse_job(document)
    assert job.spec.stability.on_spike == "alert"
    assert job.spec.stability.detector.grad_norm.critical_z == 8.0
    document["spec"]["stability"]["detector"]["gradNorm"]["warningZ"] = 9.0
    with pytest.raises(JobFileError) as error:
        parse_job(document)
    assert "spec.stability.detector.gradNorm" in str(error.value)
    assert "warning level must be ≤ the critical level" in str(error.value)


@pytest.mark.parametrize(
    "bad",
    [
        {"rollbackLrScale": 0},
        {"maxRollbacks": -1},
        {"detector": {"entropy": {"warningRatio": 0.2, "criticalRatio": 0.3}}},
        {"detector": {"sustained": {"window": 0}}},
        {"detector": {"nonFinite": {"ignore": "loss"}}},
    ],
)
def test_bad_stability_values_are_rejected(bad: dict):
    with pytest.raises(ValidationError):
        StabilitySpec.model_validate(bad, by_alias=True, by_name=False)
