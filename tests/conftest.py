"""Settings shared by every test folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One thread per process, for the test processes and all they start (rlft train, torchrun
# ranks, rollout servers) unless a test sets its own: make test runs three workers and
# their jobs on two cores, where torch's default of a thread per core leaves threads
# spinning for cores the other processes hold. Speed is measured by bench/, not here.
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
from checkpoint_fixtures import bucket, s3_env, seaweed, store_proxy  # noqa: E402, F401

# The loopback OTLP/HTTP receiver serves the tracing tests (unit and end to end).
from otlp_receiver import otlp_receiver  # noqa: E402, F401


@pytest.fixture
def one_torch_thread():
    """Whole-job tests train with one thread: steadier timings on 2 cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def transformers_tying_left_on():
    """A test that left transformers' weight tying off (a `from_pretrained` on a thread,
    outside `rlft.trainer.model.construct`) fails itself, not a later test of its worker
    whose tied model then came out untied."""
    yield
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None:
        for name in ("tie_weights", "init_weights"):
            method = getattr(modeling.PreTrainedModel, name)
            assert method.__qualname__ == f"PreTrainedModel.{name}", (
                f"transformers' PreTrainedModel.{name} was left replaced by {method.__qualname__}"
            )


# make test runs the suite on pytest-xdist workers (`-n`, `--dist loadfile`): a test file
# at a time per worker, so each module-scoped fixture (a server, a test cluster) is built
# once. The test cluster's files run in two lanes, each one file after another on one
# worker: two test clusters at a time side by side (testcluster.Slot keeps their
# addresses, ports and cgroups apart), while their jobs mostly wait on pods, probes and
# timeouts, which the other workers' tests fill. The lanes hold about the same time; a
# file not listed here is a lane of its own. (A scheduler of our own because xdist 3.8's
# `xdist_group` marks have no effect under pytest 9: xdist renames `item._nodeid`, which
# pytest 9 no longer reads.)
CLUSTER_LANES = {
    "test_jobs_on_the_cluster.py": "tests/cluster (lane 1)",
    "test_probes_on_the_cluster.py": "tests/cluster (lane 1)",
    "test_volumes_on_the_cluster.py": "tests/cluster (lane 1)",
    "test_gangs_on_the_cluster.py": "tests/cluster (lane 1)",
    "test_faults_on_the_cluster.py": "tests/cluster (lane 2)",
    "test_platform_faults_on_the_cluster.py": "tests/cluster (lane 2)",
    "test_elastic_on_the_cluster.py": "tests/cluster (lane 2)",
    "test_process_kubelet.py": "tests/cluster (lane 2)",
}


def lane_of(path: str) -> str:
    """The scheduling unit of a test file: itself, or its test-cluster lane."""
    if path.startswith("tests/cluster/"):
        return CLUSTER_LANES.get(Path(path).name, path)
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Lanes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid.split("::", 1)[0])

    return Lanes(config, log)
