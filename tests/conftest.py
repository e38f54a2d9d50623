"""Settings shared by every test folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# `make test` replays the same examples every run, so a red CI is reproducible and a
# green one is not luck; RLFT_HYPOTHESIS_EXPLORE=1 searches new examples each run (do
# that when changing a property's code, then fix what it finds).
settings.register_profile("replay", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile("explore" if os.environ.get("RLFT_HYPOTHESIS_EXPLORE") else "replay")

# The SeaweedFS S3 fixtures serve tests in several folders (checkpoint storage, resume).
sys.path.insert(0, str(Path(__file__).parent / "integration"))
from checkpoint_fixtures import bucket, s3_env, seaweed  # noqa: E402, F401

# The loopback OTLP/HTTP receiver serves the tracing tests (unit and end to end).
from otlp_receiver import otlp_receiver  # noqa: E402, F401


@pytest.fixture
def one_torch_thread():
    """Whole-job tests train with one thread: steadier timings on 2 cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# Tests are handed to pytest-xdist's workers (make test: `-n`, `--dist loadgroup`) a file
# at a time, so each module-scoped fixture (a server, a warm-started model) is built once.
# The test cluster's files share one group, so one worker runs them one after another:
# the cluster's pods listen on fixed ports of 0.0.0.0 (there are no network namespaces),
# so two test clusters at once would clash.
CLUSTER_FILES = ("tests/cluster/test_process_kubelet.py", "tests/cluster/test_")
ON_THE_CLUSTER = "_on_the_cluster.py"


def xdist_group_of(path: str) -> str:
    if path == CLUSTER_FILES[0] or (
        path.startswith(CLUSTER_FILES[1]) and path.endswith(ON_THE_CLUSTER)
    ):
        return "test-cluster"
    return path


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.location[0])))
