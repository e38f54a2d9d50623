"""Engines as the rollout server hosts them: built from a published Hugging Face folder,
updated in place to a new policy version, generating with a per-request seed.

`transformers` wraps the in-process `TransformersEngine` (runs anywhere); `vllm` lives in
`vllm_engine.py` and is imported only when asked for (it needs its own environment on
these machines, see docs/build.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from rlft.trainer.rollout.engine import Completion, SamplingParams, check_names
from rlft.trainer.rollout.transformers_engine import TransformersEngine


class ServedEngine(Protocol):
    name: str
    policy_version: int
    vocab_size: int
    max_positions: int | None
    """Prompt plus completion tokens the model has positions for (None: unknown)."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | None,
        stop_ids: list[int],
    ) -> list[Completion]: ...

    def load_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def load_folder(self, folder: Path, version: int) -> None: ...

    def close(self) -> None: ...


def load_named(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy Hugging Face-named tensors into `model`, once their names are checked (a set
    that is not the model's is refused with the model untouched)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    check_names(model.state_dict().keys(), tensors.keys(), tied)
    model.load_state_dict(tensors, strict=False)  # strict but for the tied alias


class TransformersServed:
    """The transformers engine on a model of its own (not shared with a trainer)."""

    name = "transformers"

    def __init__(self, folder: Path, version: int = 0):
        from transformers import AutoModelForCausalLM

        from rlft.trainer.model.construct import from_pretrained

        self.model = from_pretrained(AutoModelForCausalLM, folder).eval()
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        eos = config.eos_token_id
        self.default_stops = [eos] if isinstance(eos, int) else list(eos or [])
        self.policy_version = version

    def generate(self, prompts, n, sampling, seed, stop_ids) -> list[Completion]:
        engine = TransformersEngine(self.model, self.pad_id, stop_ids or self.default_stops)
        engine.set_policy_version(self.policy_version)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return engine.generate(prompts, n, sampling, generator)

    def load_tensors(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            load_named(self.model, tensors)
        self.policy_version = version

    def load_folder(self, folder: Path, version: int) -> None:
        from rlft.trainer.weights.store import read_tensors

        self.load_tensors(read_tensors(folder), version)

    def close(self) -> None:
        pass


def resolve_engine(kind: str) -> str:
    """`auto` is vLLM where this interpreter can import it, else transformers."""
    if kind != "auto":
        return kind
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


def build_engine(
    kind: str,
    folder: Path,
    version: int,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    published: bool = True,
) -> ServedEngine:
    """An engine serving `folder` as `version`: a folder rlft published (`published`), or
    the job's own model, whose files may name its tensors otherwise than rlft does."""
    kind = resolve_engine(kind)
    if kind == "transformers":
        return TransformersServed(folder, version)
    if kind == "vllm":
        from rlft.trainer.rollout.vllm_engine import VllmEngine

        return VllmEngine(folder, version, tensor_parallel, expert_parallel, published=published)
    raise ValueError(f"unknown rollout engine {kind!r}: use transformers or vllm")
