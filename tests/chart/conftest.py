"""Shared setup of the chart tests. No torch here: the chart, the images' entrypoints and the
operator need none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# The helpers beside this file, and the operator tests' emulated API server and CRD
# validation, are imported by name.
sys.path.insert(0, str(HERE.parent / "operator"))
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def chart():
    import chart_render

    loaded = chart_render.load()
    yield loaded
    loaded.close()
