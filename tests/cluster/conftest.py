"""The test cluster for the job tests: one per module, with the operator installed and
SeaweedFS credentials in the Secret `s3-creds` of namespace `ml`; a Prometheus scraping
its pods; the uninterrupted run the fault tests compare with."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_jobs import NS, end_every_job, pod_targets
from faults import faulty_job, uninterrupted
from prometheus_fixtures import Prometheus, start_prometheus, stop_prometheus
from testcluster import ProcessCluster

from rlft.trainer.telemetry.generate import RULES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("jobs-cluster"), nodes=2) as running:
        running.install_operator(NS, seaweed.credentials(), secret="s3-creds")
        yield running


@pytest.fixture(autouse=True)
def one_job_at_a_time(request) -> Iterator[None]:
    """Each test on a module's cluster starts with no job pod left by the one before."""
    yield
    if "cluster" in request.fixturenames:
        end_every_job(request.getfixturevalue("cluster"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[tuple[int, str]]:
    """(step, data digest) of the fault tests' job run without a fault, 45 steps (the
    longest of them, the elastic gang's): the sequence every faulty run's kept history
    must repeat."""
    return uninterrupted(faulty_job("reference", "none"), tmp_path_factory.mktemp("ref"), 45)


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory) -> Iterator[Prometheus]:
    """A real Prometheus scraping the job pods' /metrics every second (the pods it finds
    through the API server), with rlft's alert rules."""
    folder = tmp_path_factory.mktemp("prometheus")
    targets = folder / "pods.json"
    targets.write_text("[]")
    scrape = {
        "job_name": "rlft-pods",
        "scrape_interval": "1s",
        "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
    }
    server = start_prometheus(folder, [], [ROOT / RULES], [scrape])
    stop = threading.Event()

    def discover() -> None:
        while not stop.wait(0.5):
            with contextlib.suppress(OSError, ValueError):
                fresh = folder / "pods.json.tmp"
                fresh.write_text(json.dumps(pod_targets(cluster)))
                fresh.replace(targets)

    thread = threading.Thread(target=discover, daemon=True)
    thread.start()
    yield server
    stop.set()
    thread.join(timeout=5)
    stop_prometheus(server)
