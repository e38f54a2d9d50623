"""Policy models: a local Hugging Face folder, or a small one built from the job's config."""

from __future__ import annotations

import copy
import types
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3MoeConfig,
)

from rlft.trainer.algorithms.objectives import expert_count
from rlft.trainer.config import ModelInit, ModelSpec
from rlft.trainer.model.construct import from_config, from_pretrained
from rlft.trainer.model.tokenizer import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(Exception):
    """The model or tokenizer named by the job cannot be loaded."""


def model_config(init: ModelInit, vocab_size: int, pad_id: int, eos_id: int) -> PretrainedConfig:
    """A transformers config for a randomly initialised model of the given family."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=init.hidden_size,
        num_hidden_layers=init.num_layers,
        num_attention_heads=init.num_heads,
        num_key_value_heads=init.num_kv_heads,
        max_position_embeddings=init.max_position_embeddings,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    if init.family == "llama":
        return LlamaConfig(intermediate_size=init.intermediate_size, **common)
    if init.family == "mixtral":
        return MixtralConfig(
            intermediate_size=init.moe_intermediate_size,
            num_local_experts=init.num_experts,
            num_experts_per_tok=init.experts_per_token,
            **common,
        )
    head_dim = init.hidden_size // init.num_heads
    if init.family == "qwen3":
        return Qwen3Config(intermediate_size=init.intermediate_size, head_dim=head_dim, **common)
    return Qwen3MoeConfig(
        intermediate_size=init.intermediate_size,
        head_dim=head_dim,
        num_experts=init.num_experts,
        num_experts_per_tok=init.experts_per_token,
        moe_intermediate_size=init.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **common,
    )


def build_policy(
    spec: ModelSpec, corpus: Iterable[str], seed: int
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The job's policy model and tokenizer, in training mode without dropout, with a
    fixed init seed."""
    if spec.path is not None:
        return _load_local(Path(spec.path), spec.dtype)
    assert spec.init is not None
    tokenizer = build_tokenizer(spec.tokenizer, corpus)
    config = model_config(spec.init, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = from_config(AutoModelForCausalLM, config, dtype=DTYPES[spec.dtype])
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return disable_dropout(model), tokenizer


def _load_local(path: Path, dtype: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"spec.model.path: {path} is not a Hugging Face model folder (no config.json)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = from_pretrained(
            AutoModelForCausalLM, path, dtype=DTYPES[dtype], local_files_only=True
        )
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"spec.model.path: cannot load {path}: {error}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return disable_dropout(model), tokenizer


_DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def disable_dropout(model: PreTrainedModel) -> PreTrainedModel:
    """The model with every train-mode source of randomness switched off: dropout modules,
    the attention-dropout rates Hugging Face attention layers read in training mode (any
    float attribute named like `*dropout*`) and Mixtral's router jitter.

    The trainer keeps its models in training mode, and these algorithms compare forward
    passes with each other: the ratio π/π_old against the engine's (eval-mode)
    log-probs or the `prepare` pass, PPO's values against the old values and GAE taken
    from another pass. A fresh dropout mask on each pass would make those differ by
    noise. The config is left as it was, so an exported model keeps its own settings."""
    for module in model.modules():
        if isinstance(module, _DROPOUTS):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and ("dropout" in name or name == "jitter_noise"):
                setattr(module, name, 0.0)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_critic(policy: PreTrainedModel) -> PreTrainedModel:
    """PPO's value model: the policy's architecture and backbone weights with a scalar
    head (zero-initialised, so every value starts at 0), without dropout: its old values
    and GAE advantages (`prepare`) and its values in the loss come from separate forward
    passes in training mode, which must agree."""
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    # Without it transformers puts a Dropout(0.1) before the head of models whose config
    # has neither `classifier_dropout` nor `hidden_dropout` (Qwen3, Llama, ...). Set in
    # the config, it also holds for the critic saved to and reloaded from a checkpoint.
    config.classifier_dropout = 0.0
    critic = from_config(AutoModelForTokenClassification, config, dtype=policy.dtype)
    backbone = getattr(critic, critic.base_model_prefix)
    backbone.load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
    head = critic.score if hasattr(critic, "score") else critic.classifier
    torch.nn.init.zeros_(head.weight)
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    return disable_dropout(critic)


def to_float64(model: PreTrainedModel) -> PreTrainedModel:
    """The model in float64 (for exact gradient checks). Fused expert kernels have no
    float64 version, so MoE models switch to the per-expert loop; RMS norms compute in
    float64 too (`float64_rms_norms`)."""
    if expert_count(model.config):
        model.set_experts_implementation("eager")
    return float64_rms_norms(model.to(torch.float64))


def _rms_norm_in_input_dtype(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def float64_rms_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Every RMS norm of `model` computing in its input's dtype. transformers' RMS norms
    compute in float32 whatever the model's dtype (an upcast for bfloat16), which in a
    float64 model rounds each normalised activation, and each gradient coming back
    through it, to float32: two rows sharing a prompt then get their summed gradient
    rounded once where separate rows had theirs rounded each, and float64 gradient checks
    differed by 1e-8 instead of 1e-16. A norm is switched only where, on a test input,
    it gives what the original gives (to float32's rounding): a family whose norm differs
    (an offset weight, another epsilon's name) keeps its own."""
    # A generator of its own: the caller's random streams stay where they were.
    probe = torch.Generator().manual_seed(0)
    for _, module in _rms_norms(model):
        weight = getattr(module, "weight", None)
        if weight is None or not hasattr(module, "variance_epsilon"):
            continue
        exact = types.MethodType(_rms_norm_in_input_dtype, module)
        x = torch.randn(4, weight.shape[-1], dtype=weight.dtype, generator=probe)
        x = x.to(weight.device)
        with torch.no_grad():
            same = torch.allclose(exact(x), module(x), rtol=1e-5, atol=1e-6)
        if same:
            module.forward = exact
    return model


def float32_norms(model: torch.nn.Module) -> list[str]:
    """The RMS norms `float64_rms_norms` left with their own forward (which may round to
    float32 in a float64 model)."""
    return [name for name, module in _rms_norms(model) if "forward" not in vars(module)]


def _rms_norms(model: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    """(name, module) of every RMS norm (transformers names each family's `…RMSNorm`)."""
    return ((n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm"))
