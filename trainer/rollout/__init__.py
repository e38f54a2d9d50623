"""Rollouts: engines that generate completions with behaviour log-probs and policy
versions (transformers, vLLM), the rollout server and its client, and rank 0's side:
batch building (`batches`), the async pipeline (`pipeline`), the weight publisher
(`publisher`) and the session that ties them together (`session`)."""

from rlft.trainer.rollout.engine import Completion, SamplingParams

__all__ = ["Completion", "SamplingParams", "TransformersEngine"]


def __getattr__(name: str):
    # The engine needs torch; the CLI builds its parser (and the operator image runs it)
    # without importing torch.
    if name == "TransformersEngine":
        from rlft.trainer.rollout.transformers_engine import TransformersEngine

        return TransformersEngine
    raise AttributeError(name)
