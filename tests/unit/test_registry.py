"""The algorithm registry: one entry for every algorithm the job file accepts, each
with what the runner, the loop and `rlft verify` read from it."""

from __future__ import annotations

import typing

import pytest
import torch

from rlft.trainer.algorithms import registry
from rlft.trainer.algorithms.batch import pack
from rlft.trainer.config.algorithm import AlgorithmName, AlgorithmSpec


def test_every_name_the_job_file_accepts_is_registered_once():
    assert registry.names() == sorted(typing.get_args(AlgorithmName))
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.algorithm("grpo"))
    with pytest.raises(ValueError, match="unknown algorithm 'a2c'"):
        registry.algorithm("a2c")


@pytest.mark.parametrize(
    ("name", "source", "critic", "reference_without_kl"),
    [
        ("grpo", "rollouts", False, False),
        ("rloo", "rollouts", False, False),
        ("reinforce++", "rollouts", False, False),
        ("ppo", "rollouts", True, False),
        ("dpo", "pairs", False, True),
        ("sft", "examples", False, False),
    ],
)
def test_entries(name, source, critic, reference_without_kl):
    entry = registry.algorithm(name)
    spec = AlgorithmSpec(name=name, group_size=4)
    assert (entry.source, entry.critic) == (source, critic)
    assert entry.needs_reference(spec) is reference_without_kl
    kl = {"name": name, "groupSize": 4, "kl": {"coef": 0.1}}
    if source == "rollouts":
        assert entry.needs_reference(AlgorithmSpec.model_validate(kl))
    else:  # dpo's KL weight is its beta; sft has none: refused, not ignored
        with pytest.raises(ValueError, match=r"kl\.coef is for the RL algorithms"):
            AlgorithmSpec.model_validate(kl)
    assert (entry.shape is not None) == (source == "rollouts")
    assert registry.build_objective(spec, 1.0, 8).unit == (2 if name == "dpo" else 1)


def test_rollout_entries_shape_what_their_objective_reads():
    batch = pack([[1, 2]] * 4, [[3, 4], [5], [6, 7], [8]], 0, [[-1.0, -1.0], [-1.0]] * 2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    token_kl = torch.zeros_like(batch.mask, dtype=torch.float64)
    for name in ("grpo", "rloo", "reinforce++"):
        spec = AlgorithmSpec(name=name, group_size=2)
        shaped = registry.algorithm(name).shape(spec, batch, rewards, token_kl)
        per_sequence = (shaped.advantages * batch.mask).sum(-1) / batch.mask.sum(-1)
        assert per_sequence[0] > 0 > per_sequence[1], name  # the rewarded one of each group
    ppo = AlgorithmSpec(name="ppo", group_size=2)
    shaped = registry.algorithm("ppo").shape(ppo, batch, rewards, token_kl)
    assert shaped.token_rewards.sum(-1).tolist() == rewards.tolist()
