"""Rollout engines: generate completions with behaviour log-probs and policy versions."""

from rlft.trainer.rollout.engine import Completion, SamplingParams
from rlft.trainer.rollout.transformers_engine import TransformersEngine

__all__ = ["Completion", "SamplingParams", "TransformersEngine"]
