"""Hand-computed losses of every algorithm, and the pure parts around them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlft.trainer.algorithms.advantages import (
    gae,
    informative_groups,
    leave_one_out_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
)
from rlft.trainer.algorithms.aggregation import Normalisers, aggregate
from rlft.trainer.algorithms.batch import empty_like, micro_batches, pack, rank_shard, shard_bounds
from rlft.trainer.algorithms.losses import (
    clipped_surrogate,
    clipped_value_loss,
    kl_estimate,
    mismatch_weights,
    preference_losses,
)

F64 = torch.float64
LOSSES = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], dtype=F64)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=F64)
NORMS = Normalisers(tokens=4, sequences=2)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-sum", (6 + 4) / 2),  # 5.0
        ("seq-mean-token-mean", (2 + 4) / 2),  # 3.0
        ("constant", (1 + 2 + 3 + 4) / (2 * 5)),  # 1.0 with 5 tokens per sequence
    ],
)
def test_aggregation_modes_hand_computed(mode, expected) -> None:
    assert aggregate(LOSSES, MASK, mode, NORMS, constant=5).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_sums_over_row_splits(mode) -> None:
    whole = aggregate(LOSSES, MASK, mode, NORMS)
    parts = sum(aggregate(LOSSES[i : i + 1], MASK[i : i + 1], mode, NORMS) for i in range(2))
    assert parts.item() == pytest.approx(whole.item())


def test_aggregation_rejects_empty_batches() -> None:
    with pytest.raises(ValueError, match="no trainable tokens"):
        aggregate(LOSSES, MASK, "token-mean", Normalisers(0, 0))
    with pytest.raises(ValueError, match="constant"):
        aggregate(LOSSES, MASK, "constant", NORMS)


def test_gspo_sequence_ratio_hand_computed() -> None:
    # Sequence log-ratios: row 0 tokens (0.1, 0.3) → mean 0.2; row 1 token (-0.4).
    old = torch.zeros(2, 2, dtype=F64)
    logp = torch.tensor([[0.1, 0.3], [-0.4, 9.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=F64)
    terms = clipped_surrogate(logp, old, adv, mask, 0.5, 0.5, ratio_level="sequence")
    r0, r1 = math.exp(0.2), math.exp(-0.4)
    assert terms.ratio[0].tolist() == pytest.approx([r0, r0])
    assert terms.ratio[1, 0].item() == pytest.approx(r1)
    assert terms.loss[0].tolist() == pytest.approx([-r0, -r0])
    assert terms.loss[1, 0].item() == pytest.approx(r1)  # -min(-r1, -clip(r1)) = r1
    aggregate(terms.loss, mask, "seq-mean-token-mean", Normalisers(3, 2)).backward()
    # d/dlogp_t of -(A/2)·r0 over row 0's mean: -A·r0/|y|/2 sequences.
    assert logp.grad[0].tolist() == pytest.approx([-r0 / 2 / 2] * 2)
    assert logp.grad[1, 1].item() == 0.0  # masked token


def test_mismatch_weights_truncate_and_mask() -> None:
    old = torch.log(torch.tensor([[0.5, 0.9], [0.2, 0.2]], dtype=F64))
    behaviour = torch.log(torch.tensor([[0.1, 0.9], [0.2, 0.1]], dtype=F64))
    mask = torch.ones(2, 2, dtype=F64)
    w, rejected = mismatch_weights(old, behaviour, mask, "truncate", "token", 2.0)
    assert w.flatten().tolist() == pytest.approx([2.0, 1.0, 1.0, 2.0])  # 5 → 2, 2 stays 2
    assert rejected.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    w, _ = mismatch_weights(old, behaviour, mask, "mask", "token", 2.0)
    assert w.flatten().tolist() == pytest.approx([0.0, 1.0, 1.0, 2.0])
    w, rejected = mismatch_weights(old, behaviour, mask, "mask", "sequence", 3.0)
    assert w.flatten().tolist() == pytest.approx([0.0, 0.0, 2.0, 2.0])  # row weights 5, 2
    assert rejected[0].tolist() == [1.0, 1.0]
    w, rejected = mismatch_weights(old, behaviour, mask, "none", "token", 2.0)
    assert w.tolist() == [[1.0, 1.0], [1.0, 1.0]] and rejected.sum() == 0


def test_mismatch_mask_drops_weights_outside_one_over_cap_to_cap() -> None:
    # Weights 1/3, 3 and 1 with cap 2: MIS keeps only [1/2, 2], so it drops both the
    # weight below 1/cap and the one above cap; TIS truncates the one above cap only.
    old = torch.log(torch.tensor([[0.3, 0.9, 0.9]], dtype=F64))
    behaviour = torch.log(torch.tensor([[0.9, 0.3, 0.9]], dtype=F64))
    mask = torch.ones(1, 3, dtype=F64)
    w, rejected = mismatch_weights(old, behaviour, mask, "mask", "token", 2.0)
    assert w[0].tolist() == pytest.approx([0.0, 0.0, 1.0])
    assert rejected.tolist() == [[1.0, 1.0, 0.0]]
    w, rejected = mismatch_weights(old, behaviour, mask, "truncate", "token", 2.0)
    assert w[0].tolist() == pytest.approx([1 / 3, 2.0, 1.0])
    assert rejected.tolist() == [[0.0, 1.0, 0.0]]
    # Per sequence: the row's weight 1/3·3·1 = 1 is kept; 1/3 alone (cap 2) is not.
    w, rejected = mismatch_weights(old, behaviour, mask, "mask", "sequence", 2.0)
    assert w[0].tolist() == pytest.approx([1.0, 1.0, 1.0]) and rejected.sum() == 0
    first = torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)
    w, rejected = mismatch_weights(old, behaviour, first, "mask", "sequence", 2.0)
    assert w.tolist() == [[0.0, 0.0, 0.0]] and rejected.tolist() == [[1.0, 1.0, 1.0]]


def test_kl_estimators_hand_computed() -> None:
    logp = torch.tensor([-1.0, -2.0], dtype=F64)
    ref = torch.tensor([-1.5, -2.0], dtype=F64)  # x = 0.5, 0
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.5, 0.0])
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.0])
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx([math.exp(-0.5) - 0.5, 0])
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_rloo_and_reinforce_pp_hand_computed() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0], dtype=F64)
    # Group (1, 0): each minus the other → (1, -1); group (0, 3): (-3, 3).
    assert leave_one_out_advantages(rewards, 2).tolist() == [1.0, -1.0, -3.0, 3.0]
    three = torch.tensor([3.0, 0.0, 0.0], dtype=F64)  # 3 - 0, 0 - 1.5, 0 - 1.5
    assert leave_one_out_advantages(three, 3).tolist() == [3.0, -1.5, -1.5]
    # REINFORCE++: group-centred (0.5, -0.5, -1.5, 1.5), then whitened by its std.
    centred = torch.tensor([0.5, -0.5, -1.5, 1.5], dtype=F64)
    expected = centred / (centred.std(unbiased=False) + 1e-6)
    assert reinforce_pp_advantages(rewards, 2).tolist() == pytest.approx(expected.tolist())
    ungrouped = reinforce_pp_advantages(rewards, 1)
    assert ungrouped.mean().item() == pytest.approx(0.0, abs=1e-12)


def test_gae_hand_computed() -> None:
    # Tokens at positions 1..2 of a 4-wide row; reward 1 on the last one.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=F64)
    values = torch.tensor([[9.0, 0.5, 0.8, 9.0]], dtype=F64)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=F64)
    adv, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.8  # terminal: next value 0
    d1 = 0.0 + 0.9 * 0.8 - 0.5
    a1 = d1 + 0.9 * 0.5 * d2
    assert adv[0].tolist() == pytest.approx([0.0, a1, d2, 0.0])
    assert returns[0].tolist() == pytest.approx([0.0, a1 + 0.5, d2 + 0.8, 0.0])
    mc, _ = gae(rewards, values, mask, 1.0, 1.0)  # λ = γ = 1: reward minus value
    assert mc[0].tolist() == pytest.approx([0.0, 0.5, 0.2, 0.0])


def test_clipped_value_loss_hand_computed() -> None:
    values = torch.tensor([1.0, 0.0], dtype=F64)
    old = torch.tensor([0.5, 0.0], dtype=F64)
    returns = torch.tensor([2.0, 0.1], dtype=F64)
    # Row 0: unclipped (1-2)² = 1; clipped 0.5+0.2 = 0.7 → (0.7-2)² = 1.69 → max 1.69.
    loss = clipped_value_loss(values, old, returns, 0.2)
    assert loss.tolist() == pytest.approx([0.5 * 1.69, 0.5 * 0.01])


def test_dpo_and_ipo_hand_computed() -> None:
    chosen, rejected = torch.tensor([-1.0], dtype=F64), torch.tensor([-3.0], dtype=F64)
    ref_c, ref_r = torch.tensor([-2.0], dtype=F64), torch.tensor([-2.0], dtype=F64)
    margin = (-1 + 2) - (-3 + 2)  # 2
    loss, m = preference_losses(chosen, rejected, ref_c, ref_r, beta=0.1)
    assert m.item() == margin
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.2))))
    smooth, _ = preference_losses(chosen, rejected, ref_c, ref_r, 0.1, label_smoothing=0.1)
    expected = 0.9 * -math.log(1 / (1 + math.exp(-0.2))) + 0.1 * -math.log(1 / (1 + math.exp(0.2)))
    assert smooth.item() == pytest.approx(expected)
    ipo, _ = preference_losses(chosen, rejected, ref_c, ref_r, beta=0.5, loss="ipo")
    assert ipo.item() == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)  # (2 - 1)² = 1


def test_overlong_penalty_and_informative_groups() -> None:
    lengths = torch.tensor([4, 6, 7, 8])
    assert overlong_penalty(lengths, 8, 2, 1.0).tolist() == pytest.approx([0, 0, -0.5, -1.0])
    assert overlong_penalty(lengths, 8, 0, 1.0).tolist() == [0, 0, 0, 0]
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert informative_groups(rewards, 2).tolist() == [False, True, False]


@given(st.integers(0, 40), st.integers(1, 6), st.sampled_from([1, 2]))
def test_rank_shards_cover_the_batch_in_whole_units(units, world, unit) -> None:
    bounds = [shard_bounds(units, rank, world) for rank in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == units
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1
    if units:
        batch = pack([[1]] * (units * unit), [[2, 3]] * (units * unit), 0)
        shards = [rank_shard(batch, r, world, unit) for r in range(world)]
        assert sum(len(s) for s in shards) == units * unit
        assert all(len(s) % unit == 0 for s in shards)


def test_micro_batches_keep_pairs_together_and_trim_padding() -> None:
    batch = pack([[1], [1], [1, 2, 3], [1]], [[5], [6], [7, 8], [9]], 0)
    micros = micro_batches(batch, 3, unit=2)  # 3 rounds down to one pair per micro-batch
    assert [len(m) for m in micros] == [2, 2]
    assert micros[0].input_ids.shape[1] == 1  # trimmed: the first pair has 1-token inputs
    assert micros[1].input_ids.shape[1] == 4


def test_empty_micro_batch_contributes_nothing() -> None:
    batch = pack([[1, 2]], [[3, 4]], 0)
    empty = empty_like(batch, rows=2)
    assert (
        len(empty) == 2 and empty.mask.sum() == 0 and empty.attention_mask[:, 0].tolist() == [1, 1]
    )


@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_a_long_sequences_weight_past_floats_range_is_masked_or_capped_not_nan(mode) -> None:
    # 1000 tokens 0.1 nats apart: the sequence's log weight is 100, past float32's exp
    # (88.7). Its weight was inf, and mask's inf × 0 made the step's loss NaN.
    old = torch.full((2, 1000), -1.0)
    behaviour = old - 0.1
    behaviour[1] = old[1]  # a sequence the engine agrees on, in the same batch
    mask = torch.ones(2, 1000)
    mask[1, 500:] = 0
    behaviour[1, 500:] = -math.inf  # padding the engine never scored
    w, rejected = mismatch_weights(old, behaviour, mask, mode, "sequence", 2.0)
    assert torch.isfinite(w).all()
    assert w[0, 0].item() == (0.0 if mode == "mask" else 2.0) and rejected[0, 0].item() == 1.0
    assert w[1, 0].item() == 1.0 and rejected[1].sum().item() == 0.0
    logp = old.clone().requires_grad_()
    terms = clipped_surrogate(logp, old, torch.ones(2, 1), mask, 0.2, 0.2, "token", w)
    (terms.loss * mask).sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_filtered_sequences_still_count_in_the_sequence_normalisers() -> None:
    """4 sequences, 2 masked out by overlong filtering, a loss of 1 on each token: Dr.
    GRPO's constant normaliser counts all 4 rows as TRL's dr_grpo does (6 / (4 × 10));
    counting only those that train made it 6 / (2 × 10), twice the weight per token."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0]], dtype=F64)
    norms = Normalisers.local(mask, torch.ones_like(mask))
    assert norms.sequences == 4 and norms.tokens == 6
    ones = torch.ones_like(mask)
    assert aggregate(ones, mask, "constant", norms, 10.0).item() == pytest.approx(0.15)
    # TRL's grpo loss: the mean over all rows of each row's token mean
    assert aggregate(ones, mask, "seq-mean-token-mean", norms).item() == pytest.approx(0.5)
