"""The tiny models and job manifests the end-to-end tests train (importable from every
test folder: the root conftest's folder is on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

TINY_INIT = {
    "family": "qwen3",
    "hiddenSize": 32,
    "numLayers": 2,
    "numHeads": 2,
    "numKvHeads": 2,
    "intermediateSize": 64,
    "maxPositionEmbeddings": 64,
}
MOE_INIT = TINY_INIT | {
    "family": "qwen3-moe",
    "numExperts": 4,
    "expertsPerToken": 2,
    "moeIntermediateSize": 16,
}
TINY_MODEL = {"init": TINY_INIT, "tokenizer": {"kind": "byte"}}

# A reward that varies even for an untrained model, so every step has signal.
PARITY_REWARD = "parity_reward:parity"
_PARITY_SOURCE = "def parity(completion, answer):\n    return float(len(completion) % 2)\n"


def manifest(spec: dict, name: str = "tiny") -> dict:
    return {
        "apiVersion": "rlft.dev/v1alpha1",
        "kind": "RLFineTune",
        "metadata": {"name": name},
        "spec": spec,
    }


def write_parity_job(folder: Path, spec: dict, name: str = "tiny") -> Path:
    """`folder/job.yaml` with the parity reward module next to it (put `folder` on
    PYTHONPATH when running it)."""
    (folder / "parity_reward.py").write_text(_PARITY_SOURCE)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(spec, name)))
    return path


def arithmetic_rl_spec(algorithm: dict, steps: int = 3, init: dict = TINY_INIT, **more) -> dict:
    """A few RL steps on 2-digit sums after a 3-step warm start, parity reward."""
    return {
        "model": {"init": init, "tokenizer": {"kind": "byte"}},
        "data": {"arithmetic": {"digits": 2, "evalSize": 40}},
        "reward": {"functions": [{"name": PARITY_REWARD}]},
        "algorithm": {"sft": {"steps": 3, "batchSize": 8, "warmupSteps": 1}} | algorithm,
        "trainer": {"steps": steps, "promptsPerStep": 4, "microBatchSize": 5},
        "rollout": {"sampling": {"maxNewTokens": 4}},
        "eval": {"maxProblems": 20},
    } | more


def float64_model(family: str, vocab: int, **init: Any):
    """A tiny random model of `family` (seeded), in float64 and train mode: for tests that
    compare losses and gradients exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlft.trainer.config import ModelInit
    from rlft.trainer.model.build import model_config, to_float64
    from rlft.trainer.model.construct import from_config

    spec = ModelInit(
        family=family,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        **init,
    )
    torch.manual_seed(0)
    return to_float64(from_config(AutoModelForCausalLM, model_config(spec, vocab, 0, 1))).train()
