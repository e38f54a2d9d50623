"""Several optimizer epochs over one batch (`policyLoss.epochs`): a non-finite gradient
in a later epoch drops that epoch and the rest, and the update of those before stands
and is reported as applied (it was reported skipped, so the changed weights were
published under the old policy version)."""

from __future__ import annotations

import math

import torch

from rlft.trainer.algorithms.batch import pack
from rlft.trainer.config import TrainerSpec
from rlft.trainer.distributed import Dist
from rlft.trainer.learner.learner import Learner
from rlft.trainer.run.step_metrics import update_metrics


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))


class Quadratic:
    """|w|² per trained token; epoch `broken` (from 1) has an infinite gradient."""

    unit = 1

    def __init__(self, broken: int | None = None) -> None:
        self.broken, self.calls = broken, 0

    def prepare(self, models, micro):
        return {}

    def loss(self, models, micro, prepared, norms):
        self.calls += 1
        loss = (models.policy.w**2).sum() * (micro.mask.sum() / norms.tokens)
        if self.calls == self.broken:
            loss = loss * math.inf
        return loss, {"loss": float(loss.item())}


def trained(epochs: int, broken: int | None = None):
    policy = Policy()
    learner = Learner(policy, TrainerSpec(), Dist())
    result = learner.step(Quadratic(broken), pack([[1, 2]], [[3, 4]], 0), epochs=epochs)
    return result, policy.w.detach().clone()


def test_a_later_epochs_non_finite_gradient_drops_it_and_keeps_the_update_before():
    result, weights = trained(epochs=3, broken=2)
    _, one_epoch = trained(epochs=1)
    assert result.applied and result.action == "apply"
    assert result.dropped_epochs == 2
    assert torch.equal(weights, one_epoch) and not torch.equal(weights, torch.ones(3))
    record = update_metrics(result)
    assert record["update_applied"] and record["dropped_epochs"] == 2
    assert math.isfinite(record["grad_norm"]) and math.isfinite(record["loss"])


def test_an_unguarded_first_epochs_non_finite_gradient_is_skipped():
    """Without a guard to judge it (the warm start), a non-finite gradient in the first
    epoch is not applied: one NaN would make every weight NaN."""
    result, weights = trained(epochs=2, broken=1)
    assert not result.applied and result.action == "skip"
    assert torch.equal(weights, torch.ones(3))
    # Its tokens were not trained on: the trained-tokens counter does not count them.
    record = update_metrics(result)
    assert record["skip_reason"] and "loss" in record and "tokens" not in record
    assert update_metrics(trained(epochs=1)[0])["tokens"] == 2


def test_every_epoch_applied_when_gradients_are_finite():
    result, weights = trained(epochs=3)
    _, one_epoch = trained(epochs=1)
    assert result.applied and result.dropped_epochs == 0
    assert "dropped_epochs" not in update_metrics(result)
    assert not torch.equal(weights, one_epoch)


class CriticLoss(Quadratic):
    """The policy's |w|² plus a value loss whose gradient is infinite (a return far out
    of the critic's range)."""

    def loss(self, models, micro, prepared, norms):
        loss, stats = super().loss(models, micro, prepared, norms)
        return loss + (models.critic.w * math.inf).sum(), stats


def test_a_non_finite_critic_gradient_drops_the_critics_update_not_the_policys():
    """The guard judges the policy's gradient only: the critic's NaN update was applied,
    every critic weight became NaN, and every advantage after it."""
    policy, critic = Policy(), Policy()
    learner = Learner(policy, TrainerSpec(), Dist())
    learner.attach_critic(critic, lr=0.1)
    result = learner.step(CriticLoss(), pack([[1, 2]], [[3, 4]], 0))
    assert result.applied and not torch.equal(policy.w.detach(), torch.ones(3))
    assert torch.equal(critic.w.detach(), torch.ones(3))  # not stepped, not NaN
    assert result.critic_skipped_epochs == 1 and not math.isfinite(result.critic_grad_norm)
    assert update_metrics(result)["critic_skipped_epochs"] == 1
