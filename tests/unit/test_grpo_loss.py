"""The clipped GRPO surrogate, its k3 KL term, the global token mean, and `pack`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlft.trainer.algorithms.batch import pack
from rlft.trainer.algorithms.losses import (
    grpo_token_losses,
    kl_k3,
    masked_sum,
    sft_token_losses,
    token_entropy,
    token_logprobs,
    token_mean,
)

F64 = torch.float64

# One row per case: (ratio π/π_behaviour, advantage, loss, clipped?, d loss / d logp),
# with clipLow 0.2 and clipHigh 0.28, i.e. the trust region [0.8, 1.28].
# The loss is -min(r·A, clip(r)·A); the gradient is -A·r where the unclipped branch is
# taken and 0 where the clipped one is.
CASES = [
    # positive advantage
    (1.10, +1.0, -1.10, 0.0, -1.10),  # inside the region
    (1.25, +1.0, -1.25, 0.0, -1.25),  # inside only because clipHigh (0.28) > clipLow (0.2)
    (1.50, +1.0, -1.28, 1.0, 0.00),  # above 1 + clipHigh: clipped, no gradient
    (0.50, +1.0, -0.50, 0.0, -0.50),  # below 1 - clipLow: min keeps r·A, gradient flows
    (0.85, +1.0, -0.85, 0.0, -0.85),  # inside, near the low edge
    # negative advantage
    (1.10, -2.0, +2.20, 0.0, +2.20),  # inside
    (0.50, -2.0, +1.60, 1.0, 0.00),  # below 1 - clipLow: clipped to 0.8·(-2)
    (1.50, -2.0, +3.00, 0.0, +3.00),  # above 1 + clipHigh: min keeps r·A, gradient flows
    (1.25, -2.0, +2.50, 0.0, +2.50),  # inside
    # zero advantage: nothing to learn
    (1.50, 0.0, 0.00, 0.0, 0.00),
]
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def case_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ratio = torch.tensor([c[0] for c in CASES], dtype=F64)
    advantages = torch.tensor([c[1] for c in CASES], dtype=F64)
    behaviour = torch.linspace(-3.0, -0.1, len(CASES), dtype=F64)
    logp = (behaviour + ratio.log()).requires_grad_(True)
    return logp, behaviour, advantages


def test_clipped_surrogate_hand_computed() -> None:
    logp, behaviour, advantages = case_tensors()
    out = grpo_token_losses(logp, behaviour, advantages, CLIP_LOW, CLIP_HIGH)
    expected_loss = torch.tensor([c[2] for c in CASES], dtype=F64)
    torch.testing.assert_close(out.loss, expected_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.ratio, torch.tensor([c[0] for c in CASES], dtype=F64))
    assert out.clipped.tolist() == [c[3] for c in CASES]
    assert out.kl.tolist() == [0.0] * len(CASES)
    assert not out.ratio.requires_grad and not out.kl.requires_grad

    out.loss.sum().backward()
    expected_grad = torch.tensor([c[4] for c in CASES], dtype=F64)
    torch.testing.assert_close(logp.grad, expected_grad, rtol=0, atol=1e-12)


def test_symmetric_clip_would_clip_the_1_25_ratio() -> None:
    # The same 1.25 ratio with clipHigh = clipLow = 0.2 is clipped to 1.2: the asymmetric
    # example above is what DAPO's clip-higher changes.
    logp, behaviour, advantages = case_tensors()
    out = grpo_token_losses(logp, behaviour, advantages, 0.2, 0.2)
    assert out.loss[1].item() == pytest.approx(-1.2)
    assert out.clipped[1].item() == 1.0
    assert out.loss[8].item() == pytest.approx(2.5)  # negative A: min keeps r·A
    assert out.clipped[8].item() == 0.0


def test_per_sequence_advantages_broadcast_over_tokens() -> None:
    behaviour = torch.zeros(2, 3, dtype=F64)
    logp = torch.log(torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]], dtype=F64))
    advantages = torch.tensor([[1.0], [-1.0]], dtype=F64)
    out = grpo_token_losses(logp, behaviour, advantages, CLIP_LOW, CLIP_HIGH)
    expected = torch.tensor([[-1.0, -1.28, -0.5], [1.0, 1.5, 0.8]], dtype=F64)
    torch.testing.assert_close(out.loss, expected, rtol=0, atol=1e-12)
    assert out.clipped.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]


def test_k3_kl_is_added_with_its_coefficient() -> None:
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64, requires_grad=True)
    behaviour = logp.detach().clone()  # ratio 1: the surrogate is just -A
    advantages = torch.tensor([1.0, -1.0, 0.0], dtype=F64)
    ref = torch.tensor([-1.5, -2.0, -0.2], dtype=F64)
    # k3 = exp(ref - logp) - (ref - logp) - 1:
    #   delta -0.5 → e^-0.5 + 0.5 - 1 = 0.1065306597
    #   delta  0   → 0
    #   delta +0.3 → e^0.3 - 0.3 - 1  = 0.0498588076
    kl = [math.exp(-0.5) - 0.5, 0.0, math.exp(0.3) - 1.3]
    out = grpo_token_losses(logp, behaviour, advantages, 0.2, 0.2, ref_logp=ref, kl_coef=0.1)
    torch.testing.assert_close(out.kl, torch.tensor(kl, dtype=F64), rtol=0, atol=1e-12)
    expected = torch.tensor([-1.0 + 0.1 * kl[0], 1.0, 0.1 * kl[2]], dtype=F64)
    torch.testing.assert_close(out.loss, expected, rtol=0, atol=1e-12)

    out.loss.sum().backward()
    # d/dlogp of -A·r is -A·r = -A here; of k3 it is 1 - exp(ref - logp).
    grad = [-1.0 + 0.1 * (1 - math.exp(-0.5)), 1.0, 0.1 * (1 - math.exp(0.3))]
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=F64), rtol=0, atol=1e-12)


def test_no_kl_without_a_reference_or_with_zero_coefficient() -> None:
    logp, behaviour, advantages = case_tensors()
    plain = grpo_token_losses(logp, behaviour, advantages, CLIP_LOW, CLIP_HIGH)
    ref = logp.detach() - 1.0
    for ref_logp, coef in ((None, 0.5), (ref, 0.0)):
        out = grpo_token_losses(logp, behaviour, advantages, CLIP_LOW, CLIP_HIGH, ref_logp, coef)
        torch.testing.assert_close(out.loss, plain.loss, rtol=0, atol=0)
        assert torch.count_nonzero(out.kl) == 0
    with_kl = grpo_token_losses(logp, behaviour, advantages, CLIP_LOW, CLIP_HIGH, ref, 0.5)
    assert torch.all(with_kl.loss > plain.loss)  # k3 of a -1 gap is 1/e > 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-20, 0, allow_nan=False), st.floats(-20, 0, allow_nan=False)),
        min_size=1,
        max_size=16,
    )
)
def test_k3_is_non_negative_and_zero_only_on_agreement(pairs: list[tuple[float, float]]) -> None:
    logp = torch.tensor([p for p, _ in pairs], dtype=F64)
    ref = torch.tensor([r for _, r in pairs], dtype=F64)
    kl = kl_k3(logp, ref)
    assert torch.all(kl >= 0)
    same = logp == ref
    assert torch.all(kl[same] == 0)


# --------------------------------------------------------------------- token mean

# Three micro-batches of a 6-sequence batch holding 9 + 1 + 3 = 13 valid tokens: the
# micro-batches have different token counts, so the naive mean of means differs.
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0],
        [0, 0, 0, 0, 1],
        [1, 0, 0, 0, 0],
        [0, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
    ],
    dtype=F64,
)
SPLITS = [(0, 2), (2, 3), (3, 6)]


def loss_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(6, 5, generator=generator, dtype=F64) * 3
    logp = (behaviour + 0.4 * torch.randn(6, 5, generator=generator, dtype=F64)).requires_grad_()
    advantages = torch.randn(6, 1, generator=generator, dtype=F64)
    return logp, behaviour, advantages


def test_token_mean_equals_the_plain_masked_mean() -> None:
    losses = torch.arange(30, dtype=F64).reshape(6, 5)
    expected = (losses * MASK).sum() / MASK.sum()
    assert token_mean(losses, MASK, MASK.sum().item()).item() == pytest.approx(expected.item())
    assert masked_sum(losses, MASK).item() == (losses * MASK).sum().item()


def test_micro_batches_with_a_global_normaliser_match_the_whole_batch() -> None:
    logp, behaviour, advantages = loss_inputs()
    tokens = MASK.sum().item()
    assert tokens == 13

    whole = grpo_token_losses(logp, behaviour, advantages, CLIP_LOW, CLIP_HIGH)
    full = token_mean(whole.loss, MASK, tokens)
    (full_grad,) = torch.autograd.grad(full, logp)

    total = torch.zeros((), dtype=F64)
    for start, stop in SPLITS:
        micro = grpo_token_losses(
            logp[start:stop], behaviour[start:stop], advantages[start:stop], CLIP_LOW, CLIP_HIGH
        )
        total = total + token_mean(micro.loss, MASK[start:stop], tokens)
    (split_grad,) = torch.autograd.grad(total, logp)

    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-12)
    assert full_grad.abs().sum() > 0
    assert torch.all(full_grad[MASK == 0] == 0)


def test_naive_per_micro_batch_means_would_differ() -> None:
    logp, behaviour, advantages = loss_inputs()
    tokens = MASK.sum().item()
    full = token_mean(
        grpo_token_losses(logp, behaviour, advantages, CLIP_LOW, CLIP_HIGH).loss, MASK, tokens
    )
    naive = torch.zeros((), dtype=F64)
    for start, stop in SPLITS:
        micro = grpo_token_losses(
            logp[start:stop], behaviour[start:stop], advantages[start:stop], CLIP_LOW, CLIP_HIGH
        )
        local = MASK[start:stop]
        naive = naive + token_mean(micro.loss, local, local.sum().item()) / len(SPLITS)
    assert abs(naive.item() - full.item()) > 1e-3
    (full_grad,) = torch.autograd.grad(full, logp, retain_graph=True)
    (naive_grad,) = torch.autograd.grad(naive, logp)
    assert not torch.allclose(naive_grad, full_grad)


@pytest.mark.parametrize("tokens", [0, 0.0, -3])
def test_token_mean_rejects_no_tokens(tokens: float) -> None:
    with pytest.raises(ValueError, match="global_tokens must be positive"):
        token_mean(torch.ones(2, 2), torch.zeros(2, 2), tokens)


# ------------------------------------------------------------ log-probs, entropy


def test_token_logprobs_with_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]]])
    targets = torch.tensor([[0, 2]])
    got = token_logprobs(logits, targets, temperature=2.0)
    z = math.log(math.exp(1.0) + 1.0 + math.exp(-0.5))
    expected = torch.tensor([[1.0 - z, -math.log(3.0)]])
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(sft_token_losses(logits, targets), -token_logprobs(logits, targets))


def test_token_entropy_uniform_and_peaked() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    entropy = token_entropy(logits)
    assert entropy[0].item() == pytest.approx(math.log(4))
    assert entropy[1].item() == pytest.approx(0.0, abs=1e-6)


# --------------------------------------------------------------------------- pack

PAD = 0


def test_pack_hand_example() -> None:
    batch = pack(
        prompts=[[5, 6, 7], [8]],
        completions=[[9, 10], [11, 12, 13]],
        pad_id=PAD,
        behaviour_logp=[[-0.1, -0.2], [-0.3, -0.4, -0.5]],
        advantages=[1.5, -0.5],
    )
    # Sequences [5 6 7 9 10] and [8 11 12 13]: width = 5 - 1.
    assert batch.input_ids.tolist() == [[5, 6, 7, 9], [8, 11, 12, PAD]]
    assert batch.targets.tolist() == [[6, 7, 9, 10], [11, 12, 13, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    torch.testing.assert_close(
        batch.behaviour_logp, torch.tensor([[0, 0, -0.1, -0.2], [-0.3, -0.4, -0.5, 0]])
    )
    # One advantage per sequence, repeated on its completion tokens.
    assert batch.advantages.tolist() == [[0, 0, 1.5, 1.5], [-0.5, -0.5, -0.5, 0]]
    assert batch.tokens == 5
    assert len(batch) == 2


def test_pack_defaults_and_slice() -> None:
    batch = pack([[1, 2], [3], [4, 5, 6]], [[7], [8, 9], [10]], PAD)
    assert torch.count_nonzero(batch.advantages) == 0
    assert torch.count_nonzero(batch.behaviour_logp) == 0
    part = batch.slice(1, 3)
    assert len(part) == 2
    assert part.targets.tolist() == batch.targets[1:3].tolist()
    assert part.mask.tolist() == batch.mask[1:3].tolist()
    assert part.tokens == 3


def test_pack_needs_one_prompt_per_completion() -> None:
    with pytest.raises(ValueError):
        pack([[1], [2]], [[3]], PAD)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 50), min_size=1, max_size=6),
            st.lists(st.integers(1, 50), min_size=1, max_size=6),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_pack_properties(rows: list[tuple[list[int], list[int]]]) -> None:
    prompts = [p for p, _ in rows]
    completions = [c for _, c in rows]
    logps = [[-(i + 1) - 0.01 * j for j in range(len(c))] for i, c in enumerate(completions)]
    batch = pack(prompts, completions, PAD, logps, [float(i) for i in range(len(rows))])
    assert batch.input_ids.shape[1] == max(len(p) + len(c) for p, c in rows) - 1
    for i, (prompt, completion) in enumerate(rows):
        sequence = prompt + completion
        n = len(sequence) - 1
        mask = batch.mask[i].bool()
        # The mask covers exactly the completion tokens: those are the masked targets.
        assert batch.targets[i][mask].tolist() == completion
        assert int(mask.sum()) == len(completion)
        positions = mask.nonzero().flatten().tolist()
        assert positions == list(range(len(prompt) - 1, len(prompt) - 1 + len(completion)))
        # Targets are the inputs shifted by one.
        assert batch.input_ids[i, :n].tolist() == sequence[:-1]
        assert batch.targets[i, :n].tolist() == sequence[1:]
        assert batch.attention_mask[i].tolist() == [1] * n + [0] * (len(batch.mask[i]) - n)
        # Behaviour log-probs sit on the masked positions, zeros elsewhere.
        torch.testing.assert_close(batch.behaviour_logp[i][mask], torch.tensor(logps[i]))
        assert torch.count_nonzero(batch.behaviour_logp[i][~mask]) == 0
        assert batch.advantages[i][mask].tolist() == [float(i)] * len(completion)
        assert torch.count_nonzero(batch.advantages[i][~mask]) == 0
    assert batch.tokens == sum(len(c) for c in completions)
