"""The job file and its typed sections (pydantic, no torch): the single source of the
job's shape, read by the trainer, planned into pods by the operator, and generated into
the CRD schema and `docs/configuration.md`.

`job` holds the manifest and the sections of its spec; `algorithm`, `stability`,
`telemetry` and `pods` (a role's own pod settings) hold the larger sections; `docs` writes
the configuration reference.
"""

from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.config.base import Section
from rlft.trainer.config.job import (
    API_VERSION,
    KIND,
    ArithmeticTask,
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    JobFileError,
    JsonlTask,
    Metadata,
    ModelInit,
    ModelSpec,
    Parallelism,
    Replicas,
    Resources,
    RestartPolicy,
    RewardFunction,
    RewardSpec,
    RLFineTune,
    RLFineTuneSpec,
    RolloutSpec,
    Sampling,
    SchedulingSpec,
    TokenizerSpec,
    Toleration,
    TrainerSpec,
    dump_job,
    load_job,
    parse_job,
    problems_of,
    read_yaml,
)
from rlft.trainer.config.pods import PodCustomisation
from rlft.trainer.config.stability import StabilitySpec
from rlft.trainer.config.telemetry import TelemetrySpec

__all__ = [
    "API_VERSION",
    "KIND",
    "AlgorithmSpec",
    "ArithmeticTask",
    "CheckpointSpec",
    "DataSpec",
    "EvalSpec",
    "JobFileError",
    "JsonlTask",
    "Metadata",
    "ModelInit",
    "ModelSpec",
    "Parallelism",
    "PodCustomisation",
    "RLFineTune",
    "RLFineTuneSpec",
    "Replicas",
    "Resources",
    "RestartPolicy",
    "RewardFunction",
    "RewardSpec",
    "RolloutSpec",
    "Sampling",
    "SchedulingSpec",
    "Section",
    "StabilitySpec",
    "TelemetrySpec",
    "TokenizerSpec",
    "Toleration",
    "TrainerSpec",
    "dump_job",
    "load_job",
    "parse_job",
    "problems_of",
    "read_yaml",
]
