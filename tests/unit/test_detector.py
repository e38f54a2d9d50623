"""The collapse detector: each check on planted faults, silence on healthy noise, and
state that survives a checkpoint exactly."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rlft.trainer.config.stability import DetectorSpec
from rlft.trainer.stability.detector import (
    CHECKS,
    CRITICAL,
    OK,
    WARNING,
    Detector,
    non_finite_keys,
    robust_z,
)


def healthy(step: int, rng: random.Random, **overrides) -> dict:
    """A record like a healthy tiny GRPO step (grad norm log-normal, σ≈0.25)."""
    record = {
        "step": step,
        "policy_version": step,
        "loss": rng.gauss(0, 0.003),
        "grad_norm": math.exp(rng.gauss(0.2, 0.25)),
        "entropy": 0.3 * math.exp(rng.gauss(0, 0.1)),
        "kl": 0.02 * math.exp(rng.gauss(0, 0.1)),
        "reward_mean": min(1.0, max(0.0, rng.gauss(0.6, 0.05))),
        "ratio_mean": 1.0 + rng.gauss(0, 0.01),
        "ratio_max": 1.5 + abs(rng.gauss(0, 0.2)),
        "train_accuracy": 0.6,
    }
    record.update(overrides)
    return record


def run(records: list[dict], spec: DetectorSpec | None = None):
    detector = Detector(spec)
    return detector, [detector.observe(r) for r in records]


def stream(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [healthy(step, rng) for step in range(1, n + 1)]


def test_nan_anywhere_is_critical_from_the_first_step():
    for key in ("loss", "grad_norm", "entropy", "reward_mean"):
        record = healthy(1, random.Random(0), **{key: math.nan})
        _, [verdict] = run([record])
        assert verdict.levels["non_finite"] == CRITICAL
        assert verdict.skip_update and key in verdict.reasons[0]
    nested = healthy(1, random.Random(0), grad_norm_groups={"embed": 1.0, "mlp": math.inf})
    _, [verdict] = run([nested])
    assert verdict.skip_update and "grad_norm_groups.mlp" in verdict.reasons[0]


def test_ignored_keys_may_be_nan():
    record = healthy(1, random.Random(0), train_accuracy=math.nan)
    _, [verdict] = run([record])
    assert verdict.level == OK
    assert non_finite_keys({"a": 1.0, "b": math.nan, "c": "text", "d": True}, []) == ["b"]


def test_spike_of_10x_is_skipped_and_does_not_raise_the_bar():
    records = stream(60)
    base = records[49]["grad_norm"]
    records[50]["grad_norm"] = base * 10
    records[51]["grad_norm"] = base * 10
    detector, verdicts = run(records)
    assert all(v.level == OK for v in verdicts[:50])
    assert verdicts[50].skip_update and verdicts[51].skip_update
    assert verdicts[50].levels["grad_norm_spike"] == CRITICAL
    assert verdicts[50].zscore > DetectorSpec().grad_norm.critical_z
    assert "×" in verdicts[50].reasons[0]
    # Neither spike entered the rolling statistics.
    assert max(detector.log_grad) < math.log(base * 5)


def test_spikes_are_not_judged_during_warm_up():
    records = stream(30)
    records[5]["grad_norm"] = 1000.0
    _, verdicts = run(records)
    assert verdicts[5].levels["grad_norm_spike"] == OK
    records[25]["grad_norm"] = 1000.0
    _, verdicts = run(records)
    assert verdicts[25].levels["grad_norm_spike"] == CRITICAL


@given(seed=st.integers(0, 2**32 - 1), sigma=st.floats(0.05, 0.4))
@example(seed=70107, sigma=0.25)  # a 2.1× step at z 7.2 on a short, steady history
def test_stationary_noise_raises_no_critical_alarm(seed: int, sigma: float):
    """Healthy tiny runs have a log grad-norm scale of 0.25-0.45. With Gaussian noise of
    σ ≤ 0.4, an 8× step (criticalFactor) is a ≥5.2σ event: ~1e-7 per step. (At σ = 0.5
    it is a 4.2σ event, ~1e-5 per step: rare skips are the price of catching 10× spikes
    in noisy runs.)"""
    rng = random.Random(seed)
    records = [healthy(s, rng, grad_norm=math.exp(rng.gauss(0, sigma))) for s in range(1, 301)]
    _, verdicts = run(records)
    assert not any(v.skip_update or v.collapsed for v in verdicts)


def test_three_skipped_spikes_in_the_window_declare_collapse():
    records = stream(80)
    for step in (50, 55, 60):
        records[step]["grad_norm"] *= 50
    _, verdicts = run(records)
    assert verdicts[50].skip_update and not verdicts[50].collapsed
    assert verdicts[55].levels["sustained_spikes"] == OK
    assert verdicts[60].levels["sustained_spikes"] == CRITICAL
    assert verdicts[60].health == "collapsed"
    # The window moves on: 20 clean steps later it is over.
    assert verdicts[79].levels["sustained_spikes"] == OK


def test_warning_spikes_in_the_window_are_a_sustained_warning():
    records = stream(80)
    for step in (50, 55, 60):
        records[step]["ratio_max"] = 20.0  # a warning, not a critical step
    _, verdicts = run(records)
    assert verdicts[50].levels["importance_ratio_blowup"] == WARNING
    assert not verdicts[50].skip_update
    assert verdicts[55].levels["sustained_spikes"] == OK
    assert verdicts[60].levels["sustained_spikes"] == WARNING
    assert verdicts[60].health == "warning" and not verdicts[60].collapsed
    assert verdicts[79].levels["sustained_spikes"] == OK


def test_a_large_spike_in_a_noisy_run_is_critical_on_its_factor():
    """In a noisy run (σ = 0.5) a 10× step is only a warning by its robust z; being at
    least criticalFactor (8×) its median makes it critical all the same."""
    rng = random.Random(1)
    records = [healthy(s, rng, grad_norm=math.exp(rng.gauss(0, 0.5))) for s in range(1, 102)]
    detector, _ = run(records[:100])
    median = math.exp(statistics.median(detector.log_grad))
    verdict = detector.observe({**records[100], "grad_norm": 10 * median})
    spec = DetectorSpec().grad_norm
    assert spec.warning_z <= verdict.zscore < spec.critical_z
    assert verdict.levels["grad_norm_spike"] == CRITICAL and verdict.skip_update


def test_slow_entropy_collapse_warns_then_declares_collapse():
    records = stream(200)
    for i in range(120, 200):
        records[i]["entropy"] *= math.exp(-(i - 120) / 15)
    _, verdicts = run(records)
    levels = [v.levels["entropy_collapse"] for v in verdicts]
    assert max(levels[:120]) == OK
    first_warning, first_critical = levels.index(WARNING), levels.index(CRITICAL)
    assert 120 < first_warning < first_critical < 160
    assert verdicts[first_critical].health == "collapsed"
    assert verdicts[-1].levels["entropy_collapse"] == CRITICAL  # reference was frozen
    # Frozen: the history holds exactly the entropies of the steps not judged critical,
    # none of the collapsed ones (they would have dragged the reference down with them).
    detector, verdicts = run(records)
    kept = [r["entropy"] for r, v in zip(records, verdicts, strict=True) if v.level < CRITICAL]
    assert len(kept) < len(records) and list(detector.entropy) == kept[-len(detector.entropy) :]


def test_slow_healthy_entropy_decline_is_not_a_collapse():
    records = stream(500)
    for i, record in enumerate(records):
        record["entropy"] *= math.exp(-i / 250)  # ×0.13 over the run, like real runs
    _, verdicts = run(records)
    assert max(v.levels["entropy_collapse"] for v in verdicts) == OK


def test_entropy_floor():
    spec = DetectorSpec.model_validate({"entropy": {"floor": 0.05}})
    _, [verdict] = run([healthy(1, random.Random(0), entropy=0.01)], spec)
    assert verdict.levels["entropy_collapse"] == CRITICAL


def test_reward_collapse():
    records = stream(100)
    for record in records[60:]:
        record["reward_mean"] = 0.02
    _, verdicts = run(records)
    levels = [v.levels["reward_collapse"] for v in verdicts]
    assert max(levels[:60]) == OK
    assert levels.index(CRITICAL) <= 62
    assert "reward fell" in " ".join(verdicts[62].reasons)


def test_kl_blowup_relative_and_absolute():
    records = stream(100)
    for record in records[60:]:
        record["kl"] = 2.0  # 100× its level
    _, verdicts = run(records)
    levels = [v.levels["kl_blowup"] for v in verdicts]
    assert max(levels[:60]) == OK and CRITICAL in levels[60:65]
    _, [verdict] = run([healthy(1, random.Random(0), kl=50.0)])
    assert verdict.levels["kl_blowup"] == CRITICAL


def test_kl_growing_from_zero_is_not_a_blowup():
    records = stream(300)
    for i, record in enumerate(records):
        record["kl"] = 0.0004 * i  # steady drift away from the reference
    _, verdicts = run(records)
    assert max(v.levels["kl_blowup"] for v in verdicts) == OK


@pytest.mark.parametrize(
    ("overrides", "level"),
    [
        ({"ratio_max": 20.0}, WARNING),
        ({"ratio_max": 5000.0}, CRITICAL),
        ({"ratio_mean": 1.3}, WARNING),
        ({"ratio_mean": 0.7}, WARNING),  # far from 1 below it too
        ({"ratio_mean": 2.5}, CRITICAL),
        ({"ratio_masked_fraction": 0.6}, CRITICAL),
        ({"ratio_masked_fraction": 0.01}, OK),
    ],
)
def test_importance_ratio_blowup(overrides: dict, level: int):
    _, [verdict] = run([healthy(1, random.Random(0), **overrides)])
    assert verdict.levels["importance_ratio_blowup"] == level
    assert verdict.skip_update == (level == CRITICAL)


def test_expert_load_collapse_uses_the_recent_median():
    rng = random.Random(0)
    records = [
        healthy(s, rng, expert_imbalance_max=1.5, expert_dead_fraction=0.0) for s in range(1, 20)
    ]
    records[10]["expert_imbalance_max"] = 50.0  # one odd step: the median ignores it
    for record in records[14:]:
        record["expert_imbalance_max"] = 12.0
    _, verdicts = run(records)
    levels = [v.levels["expert_load_collapse"] for v in verdicts]
    assert max(levels[:14]) == OK and levels[-1] == CRITICAL
    _, verdicts = run([healthy(1, rng, expert_dead_fraction=0.3)])
    assert verdicts[0].levels["expert_load_collapse"] == WARNING


def test_every_check_is_reported():
    _, [verdict] = run(stream(1))
    assert set(verdict.levels) == set(CHECKS)
    assert verdict.to_dict()["health"] == "ok"


def test_robust_z():
    assert robust_z([1.0, 1.0, 1.0], 2.0, 0.5) == pytest.approx(2.0)
    assert robust_z([0.0, 1.0, 2.0], 4.0, 0.01) == pytest.approx(3 / 1.4826)


@given(
    seed=st.integers(0, 2**32 - 1),
    split=st.integers(0, 120),
    spikes=st.lists(st.integers(0, 119), max_size=6),
)
def test_state_dict_resume_gives_identical_verdicts(seed: int, split: int, spikes: list[int]):
    records = stream(120, seed)
    for i in spikes:
        records[i]["grad_norm"] *= 30
    spec = DetectorSpec.model_validate({"gradNorm": {"window": 30, "warmupSteps": 10}})
    _, straight = run(records, spec)
    first, _ = run(records[:split], spec)
    saved = json.loads(json.dumps(first.state_dict()))  # must survive JSON
    resumed = Detector(spec)
    resumed.load_state_dict(saved)
    after = [resumed.observe(r) for r in records[split:]]
    assert [v.to_dict() for v in after] == [v.to_dict() for v in straight[split:]]


def test_unknown_state_version_is_refused():
    with pytest.raises(ValueError, match="version"):
        Detector().load_state_dict({"version": 99})


def test_zero_gradients_stay_out_of_the_spike_statistics():
    records = stream(80)
    for record in records[30:70]:
        record["grad_norm"] = 0.0  # all advantages zero: a no-op step
    records[75]["grad_norm"] = 0.05  # small, after many zero steps: not a spike
    detector, verdicts = run(records)
    assert not any(v.skip_update for v in verdicts)
    assert all(math.isfinite(x) and x > -10 for x in detector.log_grad)


def test_a_small_step_is_never_critical_however_steady_the_run():
    rng = random.Random(3)
    records = [healthy(s, rng, grad_norm=math.exp(rng.gauss(0, 0.02))) for s in range(1, 61)]
    records[40]["grad_norm"] *= 2.5
    records[45]["grad_norm"] *= 4.0
    records[50]["grad_norm"] *= 6.0
    _, verdicts = run(records)
    for small in (40, 45):
        assert verdicts[small].zscore > DetectorSpec().grad_norm.critical_z
        assert verdicts[small].levels["grad_norm_spike"] == WARNING
        assert not verdicts[small].skip_update
    assert verdicts[50].levels["grad_norm_spike"] == CRITICAL
    _, verdicts = run(records, DetectorSpec.model_validate({"gradNorm": {"minCriticalFactor": 2}}))
    assert verdicts[40].levels["grad_norm_spike"] == CRITICAL


def _grad_only(xs: list[float]) -> list[dict]:
    """Records that carry only a grad norm, exp(x) for each log grad norm x."""
    return [{"step": i, "grad_norm": math.exp(x)} for i, x in enumerate(xs, start=1)]


def test_a_z_score_just_past_the_bar_is_critical_only_on_a_long_history() -> None:
    """A 6× step (between minCriticalFactor and criticalFactor) at robust z ≈ 8.1: its
    z clears criticalZ 6, but right after a 5-step warm-up the scale is widened by
    (1 + 3/5) (a MAD of 5 steps underestimates the spread): a warning. With 100 steps
    of the same spread behind it, it is critical."""
    spec = DetectorSpec.model_validate({"gradNorm": {"warmupSteps": 5}})
    pattern = [-0.15, 0.0, 0.15, -0.15, 0.15]  # median 0, MAD 0.15
    spike = {"step": 999, "grad_norm": math.exp(1.8)}
    short, verdicts = run(_grad_only(pattern), spec)
    assert all(v.level == OK for v in verdicts)
    verdict = short.observe(spike)
    assert 6.0 * (1 + 1 / 5) < verdict.zscore < 6.0 * (1 + 3 / 5)
    assert verdict.levels["grad_norm_spike"] == WARNING and not verdict.skip_update
    long, verdicts = run(_grad_only(pattern * 20), spec)
    assert all(v.level == OK for v in verdicts)
    verdict = long.observe(spike)
    assert verdict.zscore == pytest.approx(1.8 / (1.4826 * 0.15))
    assert verdict.levels["grad_norm_spike"] == CRITICAL and verdict.skip_update


def test_reward_collapse_with_negative_rewards_is_relative_to_their_size() -> None:
    """Rewards below zero (a length penalty, say): the drop is measured against the
    reference's magnitude. A 10% dip from -2 is noise; falling from -1 to -3 is a collapse."""
    dip = stream(60)
    for i, record in enumerate(dip):
        record["reward_mean"] = -2.0 if i < 50 else -2.2
    _, verdicts = run(dip)
    assert max(v.levels["reward_collapse"] for v in verdicts) == OK
    fall = stream(60)
    for i, record in enumerate(fall):
        record["reward_mean"] = -1.0 if i < 50 else -3.0
    _, verdicts = run(fall)
    levels = [v.levels["reward_collapse"] for v in verdicts]
    assert max(levels[:50]) == OK and levels.index(CRITICAL) <= 52
    assert verdicts[-1].collapsed


def test_a_spike_of_critical_factor_just_after_warm_up_is_critical() -> None:
    """The (1 + 3/n) widening right after warm-up only tempers a spike critical on its
    z-score alone: a 10× step (≥ criticalFactor) on a 5-step history is skipped, although
    its z (≈ 7.8) does not clear the widened bar (6 × 1.6)."""
    spec = DetectorSpec.model_validate({"gradNorm": {"warmupSteps": 5}})
    detector, verdicts = run(_grad_only([-0.2, 0.0, 0.2, -0.2, 0.2]), spec)  # MAD 0.2
    assert all(v.level == OK for v in verdicts)
    verdict = detector.observe({"step": 6, "grad_norm": 10.0})
    assert 6.0 < verdict.zscore < 6.0 * (1 + 3 / 5)
    assert verdict.levels["grad_norm_spike"] == CRITICAL and verdict.skip_update


def test_a_spike_is_not_judged_on_fewer_than_three_grad_norms() -> None:
    """Zero-gradient steps count towards the warm-up but leave no grad norm behind: past
    the warm-up with two grad norms only, a large step is not judged yet (two values give
    no spread); with a third it is."""
    spec = DetectorSpec.model_validate({"gradNorm": {"warmupSteps": 3}})
    detector, _ = run(_grad_only([-math.inf] * 3 + [0.0, 0.0]), spec)  # exp(-inf) = 0
    assert len(detector.log_grad) == 2
    verdict = detector.observe({"step": 6, "grad_norm": 100.0})
    assert verdict.zscore is None and verdict.levels["grad_norm_spike"] == OK
    detector.observe({"step": 7, "grad_norm": 1.0})
    verdict = detector.observe({"step": 8, "grad_norm": 100.0})
    assert verdict.levels["grad_norm_spike"] == CRITICAL and verdict.skip_update


def test_an_entropy_of_zero_throughout_is_no_collapse() -> None:
    """A run whose entropy reads 0 from the start (a reference median of 0) has nothing
    to fall from: no ratio is taken, and no collapse declared."""
    records = stream(40)
    for record in records:
        record["entropy"] = 0.0
    _, verdicts = run(records)
    assert max(v.levels["entropy_collapse"] for v in verdicts) == OK


def test_entropy_at_exactly_the_thresholds_counts() -> None:
    """warningRatio and criticalRatio are "at or below": a recent median of exactly
    0.45× (0.3×) the reference is a warning (a collapse)."""
    for ratio, level in ((0.45, WARNING), (0.3, CRITICAL)):
        records = stream(40)
        for i, record in enumerate(records):
            record["entropy"] = 1.0 if i < 30 else ratio
        _, verdicts = run(records)
        assert [v.levels["entropy_collapse"] for v in verdicts][:32] == [OK] * 32
        assert verdicts[32].levels["entropy_collapse"] == level  # 3 of the 5 recent


def test_kl_from_near_zero_is_measured_against_min_kl() -> None:
    """A reference KL far below minKl (0.01): a rise to 0.04 is 4× minKl, no blow-up,
    though it is 40× the reference; a rise to 0.5 (50× minKl) is one."""
    for recent, level in ((0.04, OK), (0.5, CRITICAL)):
        records = stream(40)
        for i, record in enumerate(records):
            record["kl"] = 0.001 if i < 30 else recent
        _, verdicts = run(records)
        assert max(v.levels["kl_blowup"] for v in verdicts[:30]) == OK
        assert verdicts[-1].levels["kl_blowup"] == level


def test_trend_checks_wait_for_min_history_reference_steps() -> None:
    """Before minHistory (20) reference steps, a reward falling from 0.6 to 0.1 is not
    judged (the first steps of a run swing); once there are enough it is a collapse."""
    records = stream(10)
    for i, record in enumerate(records):
        record["reward_mean"] = 0.6 if i < 5 else 0.1
    _, verdicts = run(records)
    assert max(v.levels["reward_collapse"] for v in verdicts) == OK
    records = stream(30)
    for i, record in enumerate(records):
        record["reward_mean"] = 0.6 if i < 25 else 0.1
    _, verdicts = run(records)
    assert verdicts[-1].levels["reward_collapse"] == CRITICAL
