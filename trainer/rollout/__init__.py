"""Rollout engines: generate completions with behaviour log-probs and policy versions."""

from rlft.trainer.rollout.engine import Completion, SamplingParams

__all__ = ["Completion", "SamplingParams", "TransformersEngine"]


def __getattr__(name: str):
    # The engine needs torch; the CLI builds its parser (and the operator image runs it)
    # without importing torch.
    if name == "TransformersEngine":
        from rlft.trainer.rollout.transformers_engine import TransformersEngine

        return TransformersEngine
    raise AttributeError(name)
