"""Batches from scored rollouts: reward shaping, filters, KL in the reward, PPO's
per-token rewards, and dynamic sampling's refill."""

from __future__ import annotations

import random

import pytest
import torch

from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.data import Problem
from rlft.trainer.rollout import Completion
from rlft.trainer.rollout.batches import (
    Rollouts,
    collect,
    preference_batch,
    rl_batch,
    wrong_answer,
)


def rollouts(rewards: list[float], lengths: list[int], finish: list[str]) -> Rollouts:
    completions = [
        Completion(i // 2, [5] * n, [-0.5] * n, f, 0)  # type: ignore[arg-type]
        for i, (n, f) in enumerate(zip(lengths, finish, strict=True))
    ]
    problems = [Problem(f"p{i}", "1") for i in range(len(rewards) // 2)]
    return Rollouts([[1, 2]] * len(problems), problems, completions, torch.tensor(rewards))


def spec(**fields) -> AlgorithmSpec:
    return AlgorithmSpec.model_validate({"groupSize": 2} | fields)


def test_grpo_batch_advantages_and_overlong_filter() -> None:
    r = rollouts([1.0, 0.0, 0.0, 0.0], [2, 4, 1, 1], ["stop", "length", "stop", "stop"])
    batch = rl_batch(spec(overlong={"filter": True}), r, 0, 4, None)
    assert batch.mask.sum(-1).tolist() == [2, 0, 1, 1]  # the truncated one is out
    per_sequence = batch.advantages.sum(-1) / batch.mask.sum(-1).clamp(min=1)
    assert per_sequence.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0], abs=1e-5)


def test_soft_overlong_penalty_changes_the_advantages() -> None:
    r = rollouts([1.0, 1.0, 0.0, 0.0], [2, 4, 1, 1], ["stop", "length", "stop", "stop"])
    plain = rl_batch(spec(scaleRewards="none"), r, 0, 4, None)
    assert plain.advantages.abs().sum() == 0
    shaped = rl_batch(
        spec(scaleRewards="none", overlong={"softPenaltyTokens": 2, "penalty": 1.0}), r, 0, 4, None
    )
    # Lengths 2 and 4 of max 4 with a 2-token buffer: penalties 0 and -1 → advantages ±0.5.
    assert shaped.advantages[0, shaped.mask[0] > 0].tolist() == pytest.approx([0.5, 0.5])
    assert shaped.advantages[1, shaped.mask[1] > 0].tolist() == pytest.approx([-0.5] * 4)


def test_kl_in_the_reward_and_ppo_token_rewards() -> None:
    r = rollouts([1.0, 0.0, 1.0, 1.0], [2, 2, 2, 2], ["stop"] * 4)

    def reference(batch):  # reference 0.1 below the behaviour log-probs: k1 = 0.1 per token
        return batch.behaviour_logp - 0.1 * batch.mask

    ppo = spec(name="ppo", kl={"coef": 0.5, "placement": "reward", "estimator": "k1"})
    batch = rl_batch(ppo, r, 0, 4, reference)
    rows = batch.token_rewards[batch.mask > 0]
    assert rows.tolist() == pytest.approx([-0.05, 0.95, -0.05, -0.05, -0.05, 0.95, -0.05, 0.95])
    grpo = spec(scaleRewards="none", kl={"coef": 1.0, "placement": "reward", "estimator": "k1"})
    r2 = rollouts([1.0, 1.0, 0.0, 0.0], [1, 3, 1, 1], ["stop"] * 4)
    batch = rl_batch(grpo, r2, 0, 4, reference)
    # Rewards 1 - 0.1 and 1 - 0.3: the group mean is 0.8, advantages ±0.1.
    assert batch.advantages[0, batch.mask[0] > 0].tolist() == pytest.approx([0.1])
    assert batch.ref_logp.sum() != 0


def test_dynamic_sampling_refills_with_informative_groups() -> None:
    rounds = iter(
        [
            rollouts([1.0, 1.0, 0.0, 1.0], [1] * 4, ["stop"] * 4),  # one informative group
            rollouts([0.0, 0.0, 1.0, 0.0], [1] * 4, ["stop"] * 4),  # one more
        ]
    )
    out = collect(lambda n: [Problem("q", "1")] * n, lambda _: next(rounds), 2, 2, True, 3)
    assert out.stats == {
        "sampling_rounds": 2,
        "groups_kept": 2,
        "groups_seen": 4,
        "samples": 8.0,  # every completion received, kept or not
    }
    assert out.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert [c.prompt_index for c in out.completions] == [0, 0, 1, 1]


def test_dynamic_sampling_gives_up_after_max_rounds() -> None:
    flat = rollouts([1.0, 1.0, 0.0, 0.0], [1] * 4, ["stop"] * 4)
    out = collect(lambda n: [Problem("q", "1")] * n, lambda _: flat, 2, 2, True, 2)
    assert out.completions == [] and out.stats["sampling_rounds"] == 2


def test_preference_pairs_put_the_answer_first() -> None:
    rng = random.Random(0)
    problems = [Problem("1+1=", "2"), Problem("x", "yes", rejected="no")]
    batch = preference_batch(problems, lambda t: [1], lambda a: [ord(c) for c in a], 0, rng)
    assert len(batch) == 4
    assert batch.targets[3, batch.mask[3] > 0].tolist() == [ord("n"), ord("o")]
    assert wrong_answer("12", random.Random(1)) != "12"


def test_jsonl_preference_pairs_are_read(tmp_path) -> None:
    from rlft.trainer.config import JsonlTask
    from rlft.trainer.data.jsonl import DataFileError, JsonlProblems

    path = tmp_path / "prefs.jsonl"
    path.write_text('{"q": "hi", "good": "hello", "bad": "go away"}\n')
    task = JsonlProblems(
        JsonlTask(train=str(path), prompt_field="q", answer_field="good", rejected_field="bad")
    )
    assert task.train_problem(random.Random(0)) == Problem("hi", "hello", "go away")
    with pytest.raises(DataFileError, match="'worse' is missing"):
        JsonlProblems(
            JsonlTask(
                train=str(path), prompt_field="q", answer_field="good", rejected_field="worse"
            )
        )
