"""Random-number-generator states as JSON, so a resume continues every random stream
exactly where it stopped (torch CPU and CUDA, Python's `random`, NumPy's global state,
and any `random.Random` or torch.Generator the caller owns). The one codec for these
states: checkpoints, the run's cursor and the rollout pipeline all use it."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def tensor_to_text(state: torch.Tensor) -> str:
    """A byte tensor (what torch's get_state returns) as base64 text."""
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def text_to_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def random_state(rng: random.Random) -> list:
    """The state of a `random.Random` (or of the `random` module itself), as JSON."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_random_state(rng: random.Random, state: list) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def copy_streams(
    rng: random.Random, generator: torch.Generator
) -> tuple[random.Random, torch.Generator]:
    """Independent copies of a data RNG and a sampling generator, in the same state."""
    own_rng, own_generator = random.Random(), torch.Generator()
    own_rng.setstate(rng.getstate())
    own_generator.set_state(generator.get_state())
    return own_rng, own_generator


def generator_state(generator: torch.Generator) -> str:
    """The state of a caller-owned torch.Generator (e.g. a data sampler's), as text."""
    return tensor_to_text(generator.get_state())


def set_generator_state(generator: torch.Generator, text: str) -> None:
    generator.set_state(text_to_tensor(text))


def capture() -> dict[str, Any]:
    """This process's global RNG states, JSON-able."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": tensor_to_text(torch.get_rng_state()),
        "python": random_state(random),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = [tensor_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict[str, Any]) -> None:
    """Set this process's global RNG states from `capture()`'s output."""
    torch.set_rng_state(text_to_tensor(state["torch"]))
    set_random_state(random, state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([text_to_tensor(s) for s in cuda])
