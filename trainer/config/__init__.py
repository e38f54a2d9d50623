"""The job file and its typed sections (pydantic, no torch): the single source of the
job's shape, read by the trainer, planned into pods by the operator, and generated into
the CRD schema and `docs/configuration.md`.

`job` holds the manifest and the top of its spec; each larger section has a module of
its own (`model`, `data`, `algorithm`, `trainer`, `rollout`, `checkpoint`, `stability`,
`scheduling`, `telemetry`), `containers` and `pods` hold what a role's pods share, `files`
reads job files, and `docs` writes the configuration reference.
"""

from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.config.base import Section
from rlft.trainer.config.checkpoint import CheckpointSpec
from rlft.trainer.config.containers import Resources
from rlft.trainer.config.data import ArithmeticTask, DataSpec, JsonlTask, RewardFunction, RewardSpec
from rlft.trainer.config.files import (
    JobFileError,
    dump_job,
    load_job,
    parse_job,
    problems_of,
    read_yaml,
)
from rlft.trainer.config.job import (
    API_VERSION,
    KIND,
    EvalSpec,
    Metadata,
    RestartPolicy,
    RLFineTune,
    RLFineTuneSpec,
)
from rlft.trainer.config.model import ModelInit, ModelSpec, TokenizerSpec
from rlft.trainer.config.pods import PodCustomisation
from rlft.trainer.config.rollout import RolloutSpec, Sampling
from rlft.trainer.config.scheduling import SchedulingSpec, Toleration
from rlft.trainer.config.stability import StabilitySpec
from rlft.trainer.config.telemetry import TelemetrySpec
from rlft.trainer.config.trainer import Parallelism, Replicas, TrainerSpec

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
