"""Container images on the test cluster: each image name (without its tag) maps to a
local environment whose `bin/` comes first on the container's PATH. A pod whose image is
not in the table fails the way an image that cannot be pulled does (ErrImagePull)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

IMAGES: dict[str, Path] = {
    # The trainer image (the operator's default for trainer and rollout pods).
    "ghcr.io/rlft/trainer": ROOT / ".venv",
    # vLLM for the CPU, in its own environment (`make vllm`).
    "ghcr.io/rlft/rollout-vllm": ROOT / ".venv-vllm",
    # Plain Python for the test cluster's own tests.
    "python": Path(sys.executable).parent.parent,
}


def image_name(image: str) -> str:
    """`registry/name:tag@digest` → `registry/name`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    return name


def environment_of(image: str) -> Path | None:
    """The environment an image maps to, or None (not pullable here)."""
    folder = IMAGES.get(image_name(image))
    if folder is None or not (folder / "bin").is_dir():
        return None
    return folder
