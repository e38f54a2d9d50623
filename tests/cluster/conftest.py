"""The test cluster for the job tests: one per module, with the operator installed and
SeaweedFS credentials in the Secret `s3-creds` of namespace `ml`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster_jobs import NS
from faults import faulty_job, uninterrupted
from testcluster import ProcessCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("jobs-cluster"), nodes=2) as running:
        running.install_operator(NS, seaweed.credentials(), secret="s3-creds")
        yield running


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[tuple[int, str]]:
    """(step, data digest) of the fault tests' job run without a fault, 24 steps: the
    sequence every faulty run's kept history must repeat."""
    return uninterrupted(faulty_job("reference", "none"), tmp_path_factory.mktemp("ref"), 24)
