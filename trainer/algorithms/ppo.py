"""PPO: the clipped surrogate with GAE advantages from a critic, and the critic's clipped
value loss; its batch carries per-token rewards (the outcome on the last token, KL
folded in per token when placed in the reward)."""

from __future__ import annotations

import torch

from rlft.trainer.algorithms.advantages import gae
from rlft.trainer.algorithms.aggregation import aggregate
from rlft.trainer.algorithms.batch import SequenceBatch, last_token_rewards
from rlft.trainer.algorithms.losses import clipped_value_loss
from rlft.trainer.algorithms.objectives import Models, PolicyGradient, Prepared
from rlft.trainer.algorithms.registry import Algorithm, register
from rlft.trainer.config.algorithm import AlgorithmSpec


class PPO(PolicyGradient):
    """PPO: the clipped surrogate with GAE advantages from a critic, and the clipped value
    loss for the critic (its own parameters, so one backward serves both)."""

    shares_prompts = False

    def prepare(self, models: Models, micro: SequenceBatch) -> Prepared:
        prepared = super().prepare(models, micro)
        values = _values(models.critic, micro)
        # At the values' upcast precision (float32 at least, whatever the critic's dtype):
        # GAE's backward recursion accumulates over every token of a row.
        adv, returns = gae(
            micro.token_rewards.to(values.dtype),
            values,
            micro.mask.to(values.dtype),
            self.spec.ppo.gamma,
            self.spec.ppo.lam,
        )
        return prepared | {"old_values": values, "returns": returns, "advantages": adv}

    def advantages(self, micro: SequenceBatch, prepared: Prepared) -> torch.Tensor:
        return prepared["advantages"]

    def loss(self, models, micro, prepared, norms):
        policy_loss, sums = super().loss(models, micro, prepared, norms)
        values = _values(models.critic, micro)
        per_token = clipped_value_loss(
            values, prepared["old_values"], prepared["returns"], self.spec.ppo.value_clip
        )
        value_loss = aggregate(per_token, micro.mask, "token-mean", norms)
        sums["value_loss"] = value_loss.item()
        return policy_loss + value_loss, sums


def _values(critic: torch.nn.Module | None, micro: SequenceBatch) -> torch.Tensor:
    """The critic's value of each position, in float32 (float64 for a float64 critic):
    a bf16/fp16 critic's outputs would otherwise carry its ~3 significant digits into
    GAE's accumulation and the value loss, as the policy's log-probs are upcast too."""
    if critic is None:
        raise ValueError("PPO needs a critic model")
    values = critic(input_ids=micro.input_ids, attention_mask=micro.attention_mask).logits[..., 0]
    return values.to(torch.float64 if values.dtype == torch.float64 else torch.float32)


def _token_rewards(
    spec: AlgorithmSpec, batch: SequenceBatch, rewards: torch.Tensor, token_kl: torch.Tensor
) -> SequenceBatch:
    token_rewards = last_token_rewards(batch.mask, rewards)
    if spec.kl.coef > 0 and spec.kl.placement == "reward":
        token_rewards = token_rewards - spec.kl.coef * token_kl
    return batch.with_fields(token_rewards=token_rewards.to(batch.mask.dtype))


ENTRY = register(
    Algorithm(
        "ppo",
        lambda spec, temperature, max_new_tokens: PPO(spec, temperature, max_new_tokens),
        _token_rewards,
        critic=True,
    )
)
