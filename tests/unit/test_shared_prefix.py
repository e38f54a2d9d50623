"""Reading each group's prompt once (`algorithms/prefix.py`) gives the loss, statistics
and gradient of the plain forward over the whole batch in float64 (the loss to 1e-10,
each gradient to 1e-12 of its largest entry): for groups of several prompt lengths, a
one-token prompt, a filler row without trained tokens, extra padding, every loss
aggregation and mismatch correction. The shared path is taken only where rows do share
a prompt."""

from __future__ import annotations

import pytest
import torch
from tiny_jobs import float64_model

from rlft.trainer.algorithms import objectives
from rlft.trainer.algorithms.aggregation import Normalisers
from rlft.trainer.algorithms.batch import empty_like, pack
from rlft.trainer.algorithms.objectives import Models, PolicyGradient
from rlft.trainer.algorithms.prefix import completion_layout
from rlft.trainer.config.algorithm import AlgorithmSpec

VOCAB = 40


def grouped_batch(filler: bool = True):
    """Groups of 3 completions of prompts of 5, 2, 1 and 7 tokens, varied lengths."""
    gen = torch.Generator().manual_seed(1)
    prompts, completions = [], []
    for length in (5, 2, 1, 7):
        prompt = torch.randint(2, VOCAB, (length,), generator=gen).tolist()
        for _ in range(3):
            size = int(torch.randint(1, 6, (1,), generator=gen))
            prompts.append(prompt)
            completions.append(torch.randint(2, VOCAB, (size,), generator=gen).tolist())
    logp = [(-torch.rand(len(c), generator=gen, dtype=torch.float64)).tolist() for c in completions]
    advantages = torch.randn(len(prompts), generator=gen, dtype=torch.float64).tolist()
    batch = pack(prompts, completions, 0, logp, advantages).to(torch.float64)
    if filler:
        extra = empty_like(batch)
        batch = type(batch)(
            **{
                name: torch.cat([getattr(batch, name), getattr(extra, name)])
                for name in batch.__dataclass_fields__
            }
        )
    return batch


def loss_and_grads(objective, model, micro):
    norms = Normalisers.local(micro.mask, micro.attention_mask)
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        prepared = objective.prepare(Models(model), micro)
    loss, sums = objective.loss(Models(model), micro, prepared, norms)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), sums, grads


def plain(objective_class):
    class Plain(objective_class):
        shares_prompts = False

    return Plain


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "policy_loss",
    [
        {"aggregation": "token-mean"},
        {"aggregation": "seq-mean-token-mean", "ratio_level": "sequence"},
        {"aggregation": "seq-mean-token-sum"},
    ],
)
@pytest.mark.parametrize("mismatch", ["none", "truncate"])
def test_the_shared_prefix_forward_matches_the_whole_batch(family, policy_loss, mismatch):
    model = float64_model(family, VOCAB)
    spec = AlgorithmSpec.model_validate(
        {
            "name": "grpo",
            "group_size": 3,
            "policy_loss": policy_loss,
            "mismatch": {"mode": mismatch},
        }
    )
    batch = grouped_batch()
    shared = PolicyGradient(spec, 1.0, 5.0)
    whole = plain(PolicyGradient)(spec, 1.0, 5.0)
    assert completion_layout(batch) is not None
    loss_a, sums_a, grads_a = loss_and_grads(shared, model, batch)
    loss_b, sums_b, grads_b = loss_and_grads(whole, model, batch)
    padded_loss, _, padded_grads = loss_and_grads(shared, model, batch.padded_to(30, 0))
    assert torch.isfinite(loss_a)
    assert abs(float(loss_a - loss_b)) <= 1e-10 * max(1.0, abs(float(loss_b)))
    assert abs(float(padded_loss - loss_b)) <= 1e-10 * max(1.0, abs(float(loss_b)))
    for key in ("entropy", "clip", "ratio", "ratio_max", "ratio_min", "is_weight"):
        assert sums_a[key] == pytest.approx(sums_b[key], rel=1e-10, abs=1e-12), key
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_b.items():
        scale = grad.abs().max().clamp(min=1e-12)
        assert (grads_a[name] - grad).abs().max() / scale <= 1e-12, name
        assert (padded_grads[name] - grad).abs().max() / scale <= 1e-12, name


def test_the_shared_path_is_taken_only_where_rows_share_a_prompt(monkeypatch):
    calls = []
    real = objectives.shared_prefix_logits
    monkeypatch.setattr(objectives, "shared_prefix_logits", lambda *a: calls.append(1) or real(*a))
    model = float64_model("qwen3", VOCAB)
    objective = PolicyGradient(AlgorithmSpec.model_validate({"name": "grpo"}), 1.0, 5.0)
    distinct = pack([[3, 4, 5], [6, 7, 8], [9, 10]], [[11], [12, 13], [14]], 0, None, [1, -1, 0.5])
    assert completion_layout(distinct) is None
    loss_and_grads(objective, model, distinct.to(torch.float64))
    assert calls == []
    loss_and_grads(objective, model, grouped_batch(filler=False))
    assert calls == [1]


def test_the_layout_groups_consecutive_rows_with_the_same_prompt():
    batch = grouped_batch()
    layout = completion_layout(batch)
    assert layout is not None
    # four prompts of three rows, the one-token prompt's rows each alone (nothing to
    # share), and the filler row alone
    assert layout.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 4, 5, 5, 5, 6]
    assert layout.first.tolist()[:9] == [4, 4, 4, 1, 1, 1, 0, 0, 0]
    trained = (batch.mask > 0).sum(-1)
    assert (layout.valid.sum(-1) >= trained).all()
