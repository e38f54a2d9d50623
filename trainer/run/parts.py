"""The parts of a job that can reject it, built before anything is written: the task,
the rewards, the policy and its tokenizer, and the prompt/answer encoding. The job
runner and `rlft verify` build them the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlft.trainer.config import RLFineTune
from rlft.trainer.data import Task, build_task
from rlft.trainer.data.rewards import RewardModel
from rlft.trainer.model.build import build_policy
from rlft.trainer.model.encoding import Encoder
from rlft.trainer.model.tokenizer import stop_token_ids


@dataclass
class JobParts:
    task: Task
    rewards: RewardModel
    policy: torch.nn.Module
    tokenizer: Any
    encoder: Encoder
    stop_ids: list[int]


def build_parts(job: RLFineTune) -> JobParts:
    """Raises the data, reward or model error that names what to fix."""
    spec = job.spec
    task = build_task(spec.data, spec.trainer.seed)
    rewards = RewardModel(spec.reward)
    policy, tokenizer = build_policy(spec.model, task.corpus(), spec.trainer.seed)
    stops = stop_token_ids(tokenizer)
    encoder = Encoder(tokenizer, spec.data, int(stops[0]))
    return JobParts(task, rewards, policy, tokenizer, encoder, stops)
