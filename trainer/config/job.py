"""The job: an `RLFineTune` manifest and the top level of its spec, modelled with pydantic
(each large section has a module of its own; `files` reads job files).

This module is the single source of truth for the job's shape: the local trainer reads
it, the operator plans pods from it, and the CRD schema is generated from it. It must
not import torch (the operator image has none).

Every field carries a docstring (it becomes `kubectl explain` text) and every number
has bounds, so a bad file fails at load time with the field named, e.g.
`spec.trainer.microBatchSize: must be ≥ 1`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.config.base import Section
from rlft.trainer.config.checkpoint import CheckpointSpec
from rlft.trainer.config.data import DataSpec, RewardSpec
from rlft.trainer.config.model import ModelSpec
from rlft.trainer.config.rollout import RolloutSpec
from rlft.trainer.config.scheduling import SchedulingSpec
from rlft.trainer.config.stability import StabilitySpec
from rlft.trainer.config.telemetry import TelemetrySpec
from rlft.trainer.config.trainer import TrainerSpec

API_VERSION = "rlft.dev/v1alpha1"
KIND = "RLFineTune"

_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class EvalSpec(Section):
    """Held-out evaluation (greedy decoding, exact match)."""

    every_steps: int = Field(0, ge=0, le=1_000_000)
    """Evaluate every N RL steps (0: only after the warm start and at the end)."""
    max_problems: int = Field(500, ge=1, le=1_000_000)
    """Held-out problems used per evaluation."""


class RestartPolicy(Section):
    """How the operator restarts failed pods."""

    max_restarts: int = Field(10, ge=0, le=10000)
    """Restarts allowed within `windowMinutes` before the job fails."""
    window_minutes: float = Field(60.0, gt=0, le=525600)
    """Sliding window in which restarts are counted."""
    backoff_seconds: float = Field(10.0, ge=0, le=86400)
    """First restart delay; doubles with each further restart in the window, up to
    windowMinutes ÷ (maxRestarts + 1), so that a job failing at once after every start
    still spends its budget within the window and fails."""
    count_disruptions: bool = False
    """Whether restarts after a disruption count against `maxRestarts`: a preemption
    (by the scheduler or by Kueue), an eviction through the Eviction API (a node drain)
    or a lost node. By default they do not, so a job on preemptible capacity is not
    failed for being preempted often; each still waits `backoffSeconds`."""


class RLFineTuneSpec(Section):
    """Everything a job needs: model, algorithm, data, reward, trainer, rollout."""

    model: ModelSpec
    """The policy model."""
    algorithm: AlgorithmSpec = AlgorithmSpec()
    """The RL algorithm and its parameters."""
    data: DataSpec = DataSpec()
    """Prompts and reference answers."""
    reward: RewardSpec = RewardSpec()
    """Reward functions."""
    trainer: TrainerSpec = TrainerSpec()
    """Optimisation settings and trainer pods."""
    rollout: RolloutSpec = RolloutSpec()
    """Generation settings and rollout instances."""
    eval: EvalSpec = EvalSpec()
    """Held-out evaluation."""
    checkpoint: CheckpointSpec = CheckpointSpec()
    """Checkpoint location and cadence."""
    stability: StabilitySpec = StabilitySpec()
    """Collapse detection and response."""
    restart_policy: RestartPolicy = RestartPolicy()
    """Restart limits and backoff (Kubernetes only)."""
    suspend: bool = False
    """Suspend the job: checkpoint, then remove its pods (Kubernetes only)."""
    scheduling: SchedulingSpec = SchedulingSpec()
    """Placement of pods (Kubernetes only)."""
    telemetry: TelemetrySpec = TelemetrySpec()
    """Metrics, /status and tracing of the trainer."""

    @model_validator(mode="after")
    def _completions_fit_the_model(self) -> RLFineTuneSpec:
        # A model built here has a known context (a `path` model's is read when it loads):
        # rollout servers refused every request past it, at the first step after the warm
        # start, and the in-process engine sampled at positions never trained.
        init = self.model.init
        longest = self.rollout.sampling.max_new_tokens
        if init is not None and longest >= init.max_position_embeddings:
            raise ValueError(
                f"rollout.sampling.maxNewTokens {longest} leaves no position for a prompt in "
                f"the model's {init.max_position_embeddings} "
                "(model.init.maxPositionEmbeddings, prompt and completion together): lower "
                "maxNewTokens or raise maxPositionEmbeddings"
            )
        buffer = self.algorithm.overlong.soft_penalty_tokens
        if buffer >= longest:
            # The penalty then started at length 0 or below: every completion lost reward
            # in proportion to its length, not only those near the limit.
            raise ValueError(
                f"algorithm.overlong.softPenaltyTokens {buffer} must be below "
                f"rollout.sampling.maxNewTokens {longest}: completions longer than "
                "maxNewTokens - softPenaltyTokens are penalised (0 turns it off)"
            )
        return self


class Metadata(BaseModel):
    """Kubernetes object metadata (only what a job file needs)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=63)
    """Name of the job (DNS-1123 label): names its output folder and its pods."""
    namespace: str | None = None
    """Namespace (Kubernetes only)."""

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if not _DNS_1123.match(name):
            raise ValueError(
                "must be a DNS-1123 label: lower-case letters, digits and '-', "
                "starting and ending with a letter or digit"
            )
        return name


class RLFineTune(BaseModel):
    """An RL fine-tuning job: the manifest `kubectl apply` takes and `rlft train` runs."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["rlft.dev/v1alpha1"] = Field(alias="apiVersion")
    """Always `rlft.dev/v1alpha1`."""
    kind: Literal["RLFineTune"]
    """Always `RLFineTune`."""
    metadata: Metadata
    """Object metadata."""
    spec: RLFineTuneSpec
    """The job."""
