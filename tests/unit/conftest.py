"""Shared fixtures of the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run the tiny test models on one thread.

    On a small (2-core) machine OpenMP's hand-off between threads makes every tiny matmul
    ~1000x slower than on one thread (16 ms instead of 10 µs for a 3x32 @ 32x32). The
    previous count is restored so that tests outside tests/unit are unaffected.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT
