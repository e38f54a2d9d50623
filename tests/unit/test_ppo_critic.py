"""PPO's critic as the project builds it: deterministic in training mode (no dropout, so
`prepare`'s old values and GAE agree with the loss's values), and read in float32 at least
whatever the model's dtype (GAE and the value loss never run in bf16)."""

from __future__ import annotations

import torch
from tiny_jobs import TINY_INIT
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from rlft.trainer.algorithms.advantages import gae
from rlft.trainer.algorithms.batch import SequenceBatch, last_token_rewards, pack
from rlft.trainer.algorithms.objectives import Models
from rlft.trainer.algorithms.registry import algorithm
from rlft.trainer.config import ModelSpec
from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.model.build import build_critic, build_policy
from rlft.trainer.model.construct import from_config

TINY = TINY_INIT | {"maxPositionEmbeddings": 128}


def _policy(dtype: str = "float32") -> PreTrainedModel:
    spec = ModelSpec.model_validate({"init": TINY, "tokenizer": {"kind": "byte"}, "dtype": dtype})
    policy, _ = build_policy(spec, ["12+34=46"], seed=0)
    return policy


def _trained_head(critic: PreTrainedModel) -> PreTrainedModel:
    """The critic as after some updates: its zero-initialised head would hide any noise
    in the backbone's output (every value 0)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        weight = critic.score.weight
        weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float32))
    return critic


def _ppo_batch(completion_tokens: int = 6) -> SequenceBatch:
    completions = [list(range(8, 8 + completion_tokens)), [20, 21, 22]]
    batch = pack([[5, 6, 7], [5, 6]], completions, 0, [[-1.0] * len(c) for c in completions])
    rewards = last_token_rewards(batch.mask, torch.tensor([1.0, 0.0]))
    return batch.with_fields(token_rewards=rewards)


def _ppo():
    return algorithm("ppo").objective(AlgorithmSpec(name="ppo", group_size=2), 1.0, 8)


def test_the_critic_has_no_active_dropout_in_training_mode() -> None:
    critic = _trained_head(build_critic(_policy())).train()
    rates = [m.p for m in critic.modules() if isinstance(m, torch.nn.Dropout)]
    assert all(p == 0.0 for p in rates), rates
    assert critic.config.classifier_dropout == 0.0  # also once saved and reloaded
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = critic(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        second = critic(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert first.abs().max() > 0.1  # values that dropout would have changed
    assert torch.equal(first, second)


def test_a_critic_from_a_policy_with_dropout_in_its_config_has_none() -> None:
    # A loaded model may ask for attention dropout: the critic (and the policy, which the
    # trainer also keeps in training mode) must still give the same output every pass.
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        head_dim=16,
        attention_dropout=0.5,
    )
    torch.manual_seed(0)
    critic = _trained_head(build_critic(from_config(AutoModelForCausalLM, config))).train()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = critic(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        second = critic(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(first, second)


def test_ppo_prepare_gives_the_same_advantages_twice() -> None:
    policy = _policy()
    critic = _trained_head(build_critic(policy))
    policy.train(), critic.train()
    batch, ppo = _ppo_batch(), _ppo()
    with torch.no_grad():
        first = ppo.prepare(Models(policy, critic), batch)
        second = ppo.prepare(Models(policy, critic), batch)
    assert first["advantages"].abs().max() > 0.1
    for key in ("old_values", "returns", "advantages"):
        assert torch.equal(first[key], second[key]), key


def test_gae_of_a_bf16_critic_runs_in_float32() -> None:
    policy = _policy("bfloat16")
    critic = _trained_head(build_critic(policy))
    assert critic.dtype == torch.bfloat16
    batch = _ppo_batch(completion_tokens=60)  # a long row: GAE accumulates over it
    with torch.no_grad():
        prepared = _ppo().prepare(Models(policy, critic), batch)
        raw = critic(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    values = raw[..., 0].to(torch.float64)  # exactly the bf16 values the critic produced
    spec = AlgorithmSpec(name="ppo").ppo
    expected, returns = gae(
        batch.token_rewards.double(), values, batch.mask.double(), spec.gamma, spec.lam
    )
    torch.testing.assert_close(prepared["old_values"].double(), values, rtol=0, atol=0)
    torch.testing.assert_close(prepared["advantages"].double(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(prepared["returns"].double(), returns, rtol=0, atol=1e-6)
    for key in ("old_values", "returns", "advantages"):
        assert prepared[key].dtype == torch.float32, key


def test_a_loaded_policy_with_dropout_in_its_config_runs_without_it(tmp_path) -> None:
    # The trainer keeps the policy in training mode; its log-probs there are compared with
    # the engine's eval-mode ones and with another pass's (the clip ratio's anchor).
    spec = ModelSpec.model_validate({"init": TINY, "tokenizer": {"kind": "byte"}})
    policy, tokenizer = build_policy(spec, ["12+34=46"], seed=0)
    policy.config.attention_dropout = 0.5
    policy.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, _ = build_policy(ModelSpec.model_validate({"path": str(tmp_path)}), [], seed=0)
    assert loaded.config.attention_dropout == 0.5  # the model's own config is kept
    loaded.train()
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = loaded(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        second = loaded(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.equal(first, second)
