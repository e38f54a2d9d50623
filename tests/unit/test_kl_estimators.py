"""The `k3-ratio` KL estimator against TRL's GRPOTrainer with `use_bias_correction_kl`,
its reduction to k3, its gradient, its use in the objectives, and its config name."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Literal, get_args

import pytest
import torch

from rlft.trainer.algorithms.aggregation import Normalisers
from rlft.trainer.algorithms.batch import SequenceBatch, micro_batches, pack
from rlft.trainer.algorithms.losses import (
    KLEstimator,
    grpo_token_losses,
    importance_ratio,
    kl_estimate,
    kl_k3,
)
from rlft.trainer.algorithms.objectives import Models, PolicyGradient
from rlft.trainer.config import JobFileError, parse_job
from rlft.trainer.config.algorithm import AlgorithmSpec, KLParams
from rlft.trainer.data import Problem
from rlft.trainer.rollout import Completion
from rlft.trainer.rollout.batches import Rollouts, rl_batch

F64 = torch.float64
EXACT = {"rtol": 0.0, "atol": 1e-12}


def trl_grpo_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    ref_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    epsilon_low: float,
    epsilon_high: float,
    importance_sampling_level: Literal["token", "sequence"],
    use_bias_correction_kl: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's per-token loss and KL for loss_type "grpo"/"dapo"/"bnpo", written from
    `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py, v1.9.0 and main at
    f2cd57710) with TRL's names, so that a reader can check it line by line."""
    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    per_token_kl = (
        torch.exp(ref_per_token_logps - per_token_logps)
        - (ref_per_token_logps - per_token_logps)
        - 1
    )
    if use_bias_correction_kl:
        per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    return per_token_loss + beta * per_token_kl, per_token_kl


def random_logps(rows: int = 6, width: int = 7, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=generator, dtype=F64) * 4
    logp = (old + 0.3 * torch.randn(rows, width, generator=generator, dtype=F64)).requires_grad_()
    ref = old + 0.5 * torch.randn(rows, width, generator=generator, dtype=F64)
    mask = (torch.rand(rows, width, generator=generator) > 0.3).to(F64)
    mask[:, 0] = 1.0  # every row has a token, as TRL's sequence mean assumes
    return logp, old, ref, mask


# ------------------------------------------------------------------- the estimator


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_k3_ratio_equals_trls_bias_corrected_kl_value_and_gradient(level) -> None:
    logp, old, ref, mask = random_logps()
    ours = kl_estimate(logp, ref, "k3-ratio", importance_ratio(logp, old, mask, level))
    _, theirs = trl_grpo_per_token_loss(
        logp, old, ref, torch.zeros(6, 1), mask, 1, 0.2, 0.2, level, True
    )
    torch.testing.assert_close(ours * mask, theirs * mask, **EXACT)
    (our_grad,) = torch.autograd.grad((ours * mask).sum(), logp)
    (their_grad,) = torch.autograd.grad((theirs * mask).sum(), logp)
    torch.testing.assert_close(our_grad, their_grad, **EXACT)
    assert our_grad.abs().sum() > 0


def test_gradient_flows_through_the_ratio_as_in_trl() -> None:
    # TRL does not detach coef_1: d(r·k3)/dlogp = r·(1 - e^-x) + k3·r, x = logp - ref.
    logp, old, ref, mask = random_logps(seed=1)
    ratio = importance_ratio(logp, old, mask)
    (grad,) = torch.autograd.grad((kl_estimate(logp, ref, "k3-ratio", ratio) * mask).sum(), logp)
    r, x = ratio.detach(), (logp - ref).detach()
    k3 = torch.exp(-x) + x - 1
    torch.testing.assert_close(grad, (r * (1 - torch.exp(-x)) + k3 * r) * mask, **EXACT)
    detached = kl_estimate(logp, ref, "k3-ratio", ratio.detach())
    (detached_grad,) = torch.autograd.grad((detached * mask).sum(), logp)
    assert not torch.allclose(grad, detached_grad)


def test_k3_ratio_is_k3_in_value_on_policy_but_not_in_gradient() -> None:
    # TRL's on-policy case: old_per_token_logps = per_token_logps.detach(), so r = 1.
    logp, _, ref, mask = random_logps(seed=2)
    ratio = importance_ratio(logp, logp.detach(), mask)
    corrected = kl_estimate(logp, ref, "k3-ratio", ratio)
    plain = kl_k3(logp, ref)
    torch.testing.assert_close(corrected, plain, **EXACT)
    (corrected_grad,) = torch.autograd.grad((corrected * mask).sum(), logp)
    (plain_grad,) = torch.autograd.grad((plain * mask).sum(), logp)
    torch.testing.assert_close(corrected_grad, plain_grad + plain.detach() * mask, **EXACT)


def test_k3_ratio_without_a_ratio_is_refused() -> None:
    with pytest.raises(ValueError, match="k3-ratio KL estimator needs the importance ratio"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k3-ratio")


def test_grpo_token_losses_with_k3_ratio_equal_trls_per_token_loss() -> None:
    logp, behaviour, ref, _ = random_logps(seed=3)
    advantages = torch.randn(6, 1, generator=torch.Generator().manual_seed(3), dtype=F64)
    ones = torch.ones_like(logp)
    out = grpo_token_losses(logp, behaviour, advantages, 0.2, 0.28, ref, 0.05, "k3-ratio")
    loss, kl = trl_grpo_per_token_loss(
        logp, behaviour, ref, advantages, ones, 0.05, 0.2, 0.28, "token", True
    )
    torch.testing.assert_close(out.loss, loss, **EXACT)
    torch.testing.assert_close(out.kl, kl.detach(), **EXACT)
    (ours,) = torch.autograd.grad(out.loss.sum(), logp)
    (theirs,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(ours, theirs, **EXACT)
    plain = grpo_token_losses(logp, behaviour, advantages, 0.2, 0.28, ref, 0.05)
    plain_trl, _ = trl_grpo_per_token_loss(
        logp, behaviour, ref, advantages, ones, 0.05, 0.2, 0.28, "token", False
    )
    torch.testing.assert_close(plain.loss, plain_trl, **EXACT)


# ------------------------------------------------------------------- the objective


class TinyPolicy(torch.nn.Module):
    """Logits from an embedding table: a differentiable policy without a transformer."""

    def __init__(self, vocabulary: int = 11) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(4)
        self.table = torch.nn.Parameter(
            torch.randn(vocabulary, vocabulary, generator=generator, dtype=F64)
        )

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[input_ids])


def policy_batch(policy: TinyPolicy) -> SequenceBatch:
    generator = torch.Generator().manual_seed(5)
    lengths = [(2, 3), (1, 5), (3, 1), (2, 4), (4, 2), (1, 3)]
    prompts = [torch.randint(1, 11, (p,), generator=generator).tolist() for p, _ in lengths]
    completions = [torch.randint(1, 11, (c,), generator=generator).tolist() for _, c in lengths]
    batch = pack(prompts, completions, 0, advantages=torch.randn(6, generator=generator).tolist())
    with torch.no_grad():
        logp = torch.log_softmax(policy.table[batch.input_ids], -1)
        logp = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    def near_policy(scale: float) -> torch.Tensor:
        noise = scale * torch.randn(logp.shape, generator=generator, dtype=F64)
        return (logp + noise) * batch.mask

    return batch.to(F64).with_fields(behaviour_logp=near_policy(0.2), ref_logp=near_policy(0.5))


def objective_loss(
    spec: AlgorithmSpec, policy: TinyPolicy, batches: list[SequenceBatch], norms: Normalisers
):
    objective = PolicyGradient(spec, 1.0, None)
    total = sum(objective.loss(Models(policy), micro, {}, norms)[0] for micro in batches)
    (grad,) = torch.autograd.grad(total, policy.table)
    return total.detach(), grad


@pytest.mark.parametrize(
    ("level", "aggregation"), [("token", "token-mean"), ("sequence", "seq-mean-token-mean")]
)
def test_objective_matches_trl_and_does_not_depend_on_micro_batching(level, aggregation) -> None:
    policy = TinyPolicy()
    batch = policy_batch(policy)
    spec = AlgorithmSpec.model_validate(
        {
            "kl": {"coef": 0.1, "estimator": "k3-ratio"},
            "policyLoss": {"ratioLevel": level, "aggregation": aggregation, "clipHigh": 0.28},
        }
    )
    norms = Normalisers.local(batch.mask, batch.attention_mask)
    whole, whole_grad = objective_loss(spec, policy, [batch], norms)
    split, split_grad = objective_loss(spec, policy, micro_batches(batch, 2), norms)
    torch.testing.assert_close(split, whole, **EXACT)
    torch.testing.assert_close(split_grad, whole_grad, **EXACT)

    # TRL's per-token loss, reduced as its loss_type "bnpo" (token-mean) or "grpo"
    # (seq-mean-token-mean) does, on one process without gradient accumulation.
    logp = torch.log_softmax(policy.table[batch.input_ids], -1)
    logp = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    mask = batch.mask
    loss, _ = trl_grpo_per_token_loss(
        logp,
        batch.behaviour_logp,
        batch.ref_logp,
        batch.advantages,
        mask,
        0.1,
        0.2,
        0.28,
        level,
        True,
    )
    if aggregation == "token-mean":
        trl = (loss * mask).sum() / mask.sum()
    else:
        trl = ((loss * mask).sum(-1) / mask.sum(-1)).mean()
    (trl_grad,) = torch.autograd.grad(trl, policy.table)
    torch.testing.assert_close(whole, trl.detach(), **EXACT)
    torch.testing.assert_close(whole_grad, trl_grad, **EXACT)


def test_in_the_reward_k3_ratio_is_k3() -> None:
    completions = [
        Completion(i // 2, [5, 6, 7][: 1 + i % 3], [-0.5, -0.7, -0.2][: 1 + i % 3], "stop", 0)
        for i in range(4)
    ]
    rollouts = Rollouts(
        [[1, 2]] * 2,
        [Problem("p0", "1"), Problem("p1", "1")],
        completions,
        torch.tensor([1.0, 0.0, 0.0, 1.0]),
    )

    def reference(batch: SequenceBatch) -> torch.Tensor:
        return (batch.behaviour_logp - 0.3) * batch.mask

    def advantages(estimator: str) -> torch.Tensor:
        spec = AlgorithmSpec.model_validate(
            {
                "groupSize": 2,
                "scaleRewards": "none",
                "kl": {"coef": 1.0, "placement": "reward", "estimator": estimator},
            }
        )
        return rl_batch(spec, rollouts, 0, 4, reference).advantages

    torch.testing.assert_close(advantages("k3-ratio"), advantages("k3"), **EXACT)
    assert not torch.equal(advantages("k3"), advantages("k1"))


# ---------------------------------------------------------------------- the config

MINIMAL: dict[str, Any] = {
    "apiVersion": "rlft.dev/v1alpha1",
    "kind": "RLFineTune",
    "metadata": {"name": "tiny"},
    "spec": {"model": {"init": {}}},
}


def with_estimator(estimator: str) -> dict[str, Any]:
    document = copy.deepcopy(MINIMAL)
    document["spec"]["algorithm"] = {"kl": {"coef": 0.01, "estimator": estimator}}
    return document


def test_config_accepts_k3_ratio() -> None:
    job = parse_job(with_estimator("k3-ratio"), "job.yaml")
    assert job.spec.algorithm.kl.estimator == "k3-ratio"
    assert KLParams().estimator == "k3"


@pytest.mark.parametrize("name", ["k4", "k3_ratio", "K3"])
def test_config_rejects_unknown_estimators_naming_the_field(name: str) -> None:
    with pytest.raises(JobFileError) as caught:
        parse_job(with_estimator(name), "job.yaml")
    assert caught.value.problems == [
        "spec.algorithm.kl.estimator: must be one of 'k1', 'k2', 'k3' or 'k3-ratio'"
    ]


def test_config_and_loss_offer_the_same_estimators() -> None:
    assert get_args(KLParams.model_fields["estimator"].annotation) == get_args(KLEstimator)
