"""The rollout section: sampling, the generation engine and, on Kubernetes, the rollout
instances."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlft.trainer.config.base import Section, checked
from rlft.trainer.config.containers import EnvVar, Resources, unique_names
from rlft.trainer.config.locations import location_problem
from rlft.trainer.config.pods import PodCustomisation

MIN_TEMPERATURE = 1e-3
"""The lowest sampling temperature, here and in the rollout protocol: logits divided by
much less overflow float32 (NaN probabilities, which fail the request in the engine)."""


class Sampling(Section):
    """How completions are sampled during RL."""

    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=10)
    """Softmax temperature; behaviour log-probs are those of this distribution. At least
    0.001: logits divided by less overflow."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 the engines' behaviour log-probs differ: the
    in-process engine reports the temperature-scaled distribution's (as the trainer
    computes them), vLLM the nucleus-renormalised one's, which biases importance ratios
    low by the nucleus mass; keep 1 for RL through vLLM."""
    max_new_tokens: int = Field(16, ge=1, le=1_000_000)
    """Longest completion; longer ones are cut and marked `length`. Prompt and completion
    share the model's positions: with `model.init`, below its maxPositionEmbeddings."""


class RolloutSpec(Section):
    """Generation of completions; on Kubernetes, the rollout instances."""

    engine: Literal["auto", "transformers", "vllm"] = "transformers"
    """Generation engine: `transformers` runs anywhere; `vllm` where vLLM is installed;
    `auto` is the faster one for the job: locally, vLLM when it is installed
    (`.venv-vllm` or `RLFT_VLLM_PYTHON`) and a GPU is visible, else transformers in
    process (on the CPU it is faster; the run's first lines say which and why); in a
    rollout pod, vLLM where it is importable."""
    sampling: Sampling = Sampling()
    """Sampling parameters of RL rollouts."""
    max_staleness: int = Field(0, ge=0, le=64)
    """Largest policy lag of a trained sample (0 = synchronous, on-policy)."""
    image: str = Field("ghcr.io/rlft/trainer:latest", min_length=1, pattern=r"^\S+$")
    """Container image of rollout pods (Kubernetes only)."""
    instances: int = Field(1, ge=1, le=4096)
    """Rollout engine instances."""
    gpus_per_instance: int = Field(0, ge=0, le=512)
    """GPUs per rollout instance (Kubernetes only)."""
    tensor_parallel: int = Field(1, ge=1, le=512)
    """vLLM tensor-parallel size within an instance."""
    expert_parallel: int = Field(1, ge=1, le=512)
    """vLLM expert-parallel size within an instance (MoE models)."""
    nodes_per_instance: int = Field(1, ge=1, le=64)
    """Nodes one instance spans (more than 1 runs vLLM on a small Ray cluster)."""
    publication: Literal["store", "broadcast"] = "store"
    """How trainer rank 0 sends new weights to the instances after each step: `store`
    writes Hugging Face safetensors of the version under `weightsUri`, then POSTs
    /weights; `broadcast` sends them over a torch.distributed group (gloo on CPU, NCCL
    on GPUs). Instances that (re)start always catch up from `weightsUri`."""
    weights_uri: str | None = None
    """Where published weight versions live (file:///… or s3://…). Default: the output
    folder's `weights/` (local runs)."""

    @field_validator("weights_uri")
    @classmethod
    def _weights_location(cls, uri: str | None) -> str | None:
        return checked(uri, location_problem)

    request_timeout_seconds: float = Field(600.0, gt=0, le=86_400)
    """A generate request unanswered for this long is re-issued to another instance; one
    that no instance answered within twice this long (but within 0.9 ×
    spec.trainer.stallTimeoutSeconds, when set) ends the run, naming the instances."""
    request_prompts: int = Field(0, ge=0, le=65_536)
    """Prompts per generate request (0: the step's prompts split evenly over
    `instances`, whether or not all are up, so the samples do not depend on it); smaller
    requests balance load better and lose less when an instance dies."""
    local: Literal["auto", "in-process", "servers"] = "auto"
    """How `rlft train` generates on one machine: `in-process` shares the trainer's model
    (synchronous only), `servers` starts `instances` rollout servers as subprocesses;
    `auto` is in-process for one transformers instance with maxStaleness 0."""
    resources: Resources = Resources()
    """Resource requests and limits of rollout pods (Kubernetes only)."""
    env: list[EnvVar] = Field(default_factory=list, max_length=256)
    """Extra environment variables of rollout pods, Ray head and worker pods included
    (Kubernetes only); those the operator sets cannot be changed."""
    pod: PodCustomisation = PodCustomisation()
    """Rollout pods' own volumes and mounts, envFrom, image pull secrets, service account,
    labels, annotations, runtime class and added capabilities, Ray head and worker pods
    included (Kubernetes only)."""
    startup_timeout_seconds: int = Field(1800, ge=10, le=86_400)
    """How long a rollout pod may take to start serving (loading a large model and its
    first weights) before its startup probe fails and the pod is replaced; after that a
    readiness probe on /healthz reports whether it has weights (Kubernetes only)."""

    _env_names = field_validator("env")(unique_names)

    @model_validator(mode="after")
    def _gpus_fit_parallelism(self) -> RolloutSpec:
        parallel = self.tensor_parallel * self.expert_parallel
        if self.gpus_per_instance and self.gpus_per_instance % parallel:
            raise ValueError("gpusPerInstance must be divisible by tensorParallel × expertParallel")
        if self.local == "in-process" and (self.max_staleness or self.engine == "vllm"):
            raise ValueError(
                "local: in-process shares the trainer's model, so it needs engine: transformers "
                "(or auto) and maxStaleness: 0; use local: servers (or auto)"
            )
        return self
