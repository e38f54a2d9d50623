"""Group-relative advantages (GRPO / Dr. GRPO)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlft.trainer.algorithms.advantages import group_relative_advantages

EPS = 1e-6


def rewards_of(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_hand_computed_group_scaling() -> None:
    rewards = rewards_of([1, 0, 0, 1, 1, 1, 1, 1])
    advantages = group_relative_advantages(rewards, group_size=4)
    # Group 1: mean 0.5, population std 0.5 → ±0.5 / (0.5 + eps) ≈ ±1.
    # Group 2: all equal → 0 (the eps keeps 0/0 away).
    scale = 0.5 / (0.5 + EPS)
    expected = rewards_of([scale, -scale, -scale, scale, 0, 0, 0, 0])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    assert advantages.shape == (8,)


def test_hand_computed_unequal_group() -> None:
    # Group [3, 0, 0, 1]: mean 1, deviations [2, -1, -1, 0], population std sqrt(6/4).
    advantages = group_relative_advantages(rewards_of([3, 0, 0, 1]), group_size=4)
    std = (6 / 4) ** 0.5
    expected = rewards_of([2, -1, -1, 0]) / (std + EPS)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_scale_none_only_centres() -> None:
    rewards = rewards_of([1, 0, 0, 1, 2, 2, 2, 6])
    advantages = group_relative_advantages(rewards, group_size=4, scale="none")
    expected = rewards_of([0.5, -0.5, -0.5, 0.5, -1, -1, -1, 3])
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_scale_batch_divides_by_the_batch_std() -> None:
    rewards = rewards_of([1, 0, 0, 1, 1, 1, 1, 1])
    advantages = group_relative_advantages(rewards, group_size=4, scale="batch")
    # Batch: six ones and two zeros → mean 0.75, population std sqrt(0.75 * 0.25).
    batch_std = (0.75 * 0.25) ** 0.5
    expected = rewards_of([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (batch_std + EPS)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)
    # ...which differs from per-group scaling for the same rewards.
    assert not torch.allclose(advantages, group_relative_advantages(rewards, 4, "group"))


def test_group_size_one_group_is_the_whole_batch() -> None:
    rewards = rewards_of([0, 1, 2, 3, 4, 5])
    torch.testing.assert_close(
        group_relative_advantages(rewards, 6, "group"),
        group_relative_advantages(rewards, 6, "batch"),
    )


def test_float32_input_keeps_its_dtype() -> None:
    advantages = group_relative_advantages(torch.tensor([0.0, 1.0]), group_size=2)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor([-1.0, 1.0]), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "group_size"),
    [((7,), 4), ((2, 4), 4), ((8, 1), 4), ((), 1), ((3,), 2)],
)
def test_bad_shapes_raise_value_error(shape: tuple[int, ...], group_size: int) -> None:
    with pytest.raises(ValueError, match=f"group_size={group_size}"):
        group_relative_advantages(torch.zeros(shape), group_size)


# --------------------------------------------------------------------- properties

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)


@st.composite
def grouped_rewards(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    group_size = draw(st.integers(min_value=2, max_value=8))
    groups = draw(st.integers(min_value=1, max_value=6))
    values = draw(st.lists(finite, min_size=group_size * groups, max_size=group_size * groups))
    return rewards_of(values), group_size


@settings(max_examples=150, deadline=None)
@given(grouped_rewards(), st.sampled_from(["group", "batch", "none"]))
def test_each_group_sums_to_zero(case: tuple[torch.Tensor, int], scale: str) -> None:
    rewards, group_size = case
    advantages = group_relative_advantages(rewards, group_size, scale)
    assert advantages.shape == rewards.shape
    sums = advantages.reshape(-1, group_size).sum(dim=1)
    # Centred values are at most ~2e3 apart; scaled ones at most ~group_size in size.
    torch.testing.assert_close(sums, torch.zeros_like(sums), rtol=0, atol=1e-7)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(min_value=2, max_value=8),
    st.lists(finite, min_size=1, max_size=5),
    st.sampled_from(["group", "batch", "none"]),
)
def test_all_equal_groups_give_zeros(group_size: int, values: list[float], scale: str) -> None:
    rewards = rewards_of([v for v in values for _ in range(group_size)])
    advantages = group_relative_advantages(rewards, group_size, scale)
    assert torch.all(advantages.abs() < 1e-6), advantages


@settings(max_examples=150, deadline=None)
@given(grouped_rewards(), st.data(), st.sampled_from(["group", "none"]))
def test_invariant_to_a_constant_added_to_one_group(
    case: tuple[torch.Tensor, int], data: st.DataObject, scale: str
) -> None:
    rewards, group_size = case
    groups = rewards.numel() // group_size
    which = data.draw(st.integers(min_value=0, max_value=groups - 1))
    shift = data.draw(st.floats(min_value=-100, max_value=100, allow_nan=False))
    shifted = rewards.clone()
    shifted[which * group_size : (which + 1) * group_size] += shift
    before = group_relative_advantages(rewards, group_size, scale)
    after = group_relative_advantages(shifted, group_size, scale)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(grouped_rewards(), st.floats(min_value=-100, max_value=100, allow_nan=False))
def test_batch_scale_invariant_to_a_constant_added_to_everything(
    case: tuple[torch.Tensor, int], shift: float
) -> None:
    rewards, group_size = case
    before = group_relative_advantages(rewards, group_size, "batch")
    after = group_relative_advantages(rewards + shift, group_size, "batch")
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(grouped_rewards())
def test_group_scaled_advantages_have_unit_std(case: tuple[torch.Tensor, int]) -> None:
    rewards, group_size = case
    groups = rewards.reshape(-1, group_size)
    stds = groups.std(dim=1, unbiased=False)
    advantages = group_relative_advantages(rewards, group_size).reshape(-1, group_size)
    got = advantages.std(dim=1, unbiased=False)
    expected = stds / (stds + EPS)  # 1 for spread-out groups, 0 for constant ones
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_exactly_zero_even_when_the_mean_rounds(scale: str) -> None:
    # 682.726 * 3 / 3 != 682.726 in floating point; dividing that rounding error by a
    # near-zero std used to give advantages of ~3e-7 instead of 0.
    rewards = torch.tensor([682.726] * 3 + [0.0, 1.0, 0.0], dtype=torch.float64)
    advantages = group_relative_advantages(rewards, 3, scale)
    assert torch.equal(advantages[:3], torch.zeros(3, dtype=torch.float64))
    assert advantages[4] > 0


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_a_job_can_ask_for_trls_sample_std_and_eps(scale) -> None:
    """TRL's GRPOTrainer divides by the Bessel-corrected std plus 1e-4: a job that says
    rewardStd: sample, rewardStdEps: 1e-4 gets its advantages (on [1, 0] TRL's are ±0.707
    where the population std gives ±1)."""
    from rlft.trainer.algorithms.batch import pack
    from rlft.trainer.algorithms.registry import algorithm
    from rlft.trainer.config.algorithm import AlgorithmSpec

    rewards = rewards_of([1, 0, 0, 0, 0.25, 0.5, 0.5, 0.5])
    spec = AlgorithmSpec.model_validate(
        {"groupSize": 4, "scaleRewards": scale, "rewardStd": "sample", "rewardStdEps": 1e-4}
    )
    batch = pack([[1]] * 8, [[2, 3]] * 8, 0, [[-1.0, -1.0]] * 8)
    kl = torch.zeros_like(batch.mask, dtype=torch.float64)
    got = algorithm("grpo").shape(spec, batch, rewards, kl).advantages[:, -1]
    # TRL 1.16's formula, written out
    groups = rewards.view(-1, 4)
    std = groups.std(dim=1).repeat_interleave(4) if scale == "group" else rewards.std()
    trl = (rewards - groups.mean(dim=1).repeat_interleave(4)) / (std + 1e-4)
    torch.testing.assert_close(got, trl.to(got.dtype), rtol=1e-12, atol=0)
    default = AlgorithmSpec.model_validate({"groupSize": 4, "scaleRewards": scale})
    assert not torch.allclose(
        algorithm("grpo").shape(default, batch, rewards, kl).advantages,
        algorithm("grpo").shape(spec, batch, rewards, kl).advantages,
    )
