"""grpo, rloo and reinforce++: critic-free policy gradients whose advantage is one number
per sequence, from the rewards of its group (the clipped surrogate of `objectives`)."""

from __future__ import annotations

import torch

from rlft.trainer.algorithms.advantages import (
    group_relative_advantages,
    leave_one_out_advantages,
    reinforce_pp_advantages,
)
from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.algorithms.objectives import PolicyGradient
from rlft.trainer.algorithms.registry import Algorithm, register
from rlft.trainer.config.algorithm import AlgorithmSpec


def _outcome_shape(advantages):
    def shape(
        spec: AlgorithmSpec, batch: SequenceBatch, rewards: torch.Tensor, token_kl: torch.Tensor
    ) -> SequenceBatch:
        if spec.kl.coef > 0 and spec.kl.placement == "reward":
            rewards = rewards - spec.kl.coef * token_kl.sum(-1)
        values = advantages(spec, rewards)
        return batch.with_fields(
            advantages=(values.reshape(-1, 1) * batch.mask).to(batch.mask.dtype)
        )

    return shape


def _register(name: str, advantages) -> Algorithm:
    return register(
        Algorithm(
            name,
            lambda spec, temperature, max_new_tokens: PolicyGradient(
                spec, temperature, max_new_tokens
            ),
            _outcome_shape(advantages),
        )
    )


def _grpo_advantages(spec: AlgorithmSpec, rewards: torch.Tensor) -> torch.Tensor:
    sample = spec.reward_std == "sample"
    return group_relative_advantages(
        rewards, spec.group_size, spec.scale_rewards, spec.reward_std_eps, sample
    )


GRPO = _register("grpo", _grpo_advantages)
RLOO = _register("rloo", lambda s, r: leave_one_out_advantages(r, s.group_size))
REINFORCE_PP = _register("reinforce++", lambda s, r: reinforce_pp_advantages(r, s.group_size))
