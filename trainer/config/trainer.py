"""The trainer section: optimisation settings and, on Kubernetes, the trainer pods."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlft.trainer.config.base import Section
from rlft.trainer.config.containers import EnvVar, Resources, unique_names
from rlft.trainer.config.pods import PodCustomisation


class Replicas(Section):
    """Elastic size of the trainer group."""

    min: int = Field(1, ge=1, le=4096)
    """Training starts once this many trainer pods run."""
    max: int = Field(1, ge=1, le=4096)
    """The group may grow up to this many pods."""

    @model_validator(mode="after")
    def _min_le_max(self) -> Replicas:
        if self.min > self.max:
            raise ValueError("min must be ≤ max")
        return self


class Parallelism(Section):
    """How the trainer's model is distributed and computed (FSDP2 when world size > 1)."""

    mixed_precision: Literal["none", "bf16"] = "none"
    """`bf16`: compute in bfloat16 with float32 master weights and gradient reduction."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after the forward (ZeRO-3) instead of keeping them
    until the backward (ZeRO-2-like, more memory, less communication)."""


class TrainerSpec(Section):
    """The trainer: optimisation settings and, on Kubernetes, its pods."""

    steps: int = Field(100, ge=1, le=10_000_000)
    """RL optimizer steps to run."""
    prompts_per_step: int = Field(32, ge=1, le=1_000_000)
    """Prompts per RL step (each yields a group of completions)."""
    micro_batch_size: int = Field(64, ge=1, le=65536)
    """Sequences per forward/backward pass; gradients are accumulated over micro-batches
    and normalised globally, so this changes memory use, not the update (except a MoE
    router load-balancing loss, `moe.routerAuxCoef` > 0: it is a function of each forward
    pass)."""
    learning_rate: float = Field(1e-3, gt=0, le=1)
    """Peak learning rate of RL (AdamW, linear warm-up then constant)."""
    warmup_steps: int = Field(0, ge=0, le=1_000_000)
    """Steps of linear learning-rate warm-up."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0, le=1e6)
    """Clip the global gradient norm to this value."""
    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Seed of every random choice (model init, data order, sampling)."""
    parallelism: Parallelism = Parallelism()
    """Sharding, precision and recomputation of the training model."""
    image: str = Field("ghcr.io/rlft/trainer:latest", min_length=1, pattern=r"^\S+$")
    """Container image of trainer pods (Kubernetes only)."""
    replicas: Replicas = Replicas()
    """Elastic trainer group size (Kubernetes only)."""
    gpus_per_pod: int = Field(0, ge=0, le=64)
    """GPUs requested per trainer pod (Kubernetes only)."""
    resources: Resources = Resources()
    """Resource requests and limits of each trainer pod (Kubernetes only)."""
    env: list[EnvVar] = Field(default_factory=list, max_length=256)
    """Extra environment variables of trainer pods (Kubernetes only), e.g. NCCL_* or
    HF_* settings; those the operator sets cannot be changed."""
    pod: PodCustomisation = PodCustomisation()
    """Trainer pods' own volumes and mounts, envFrom, image pull secrets, service account,
    labels, annotations, runtime class and added capabilities (Kubernetes only)."""
    stall_timeout_seconds: int = Field(1800, ge=0, le=604_800)
    """A trainer rank that makes no progress for this long is stalled (a hung collective
    or weight sync): its pod fails its liveness probe, the gang restarts from the last
    checkpoint, and the status and an Event say `Stalled` (Kubernetes only). Progress is
    a step, a micro-batch, a rollout group arriving, an evaluation batch, a retried
    upload or a checkpoint in flight within its retry deadline; the longest single
    operation (loading the model, one checkpoint shard) must fit. 0 turns it off."""

    _env_names = field_validator("env")(unique_names)
