"""An elastic gang (`replicas: {min: 2, max: 3}`) on three nodes, one trainer pod per node,
loses a node and goes on at world size 2 from its last checkpoint (resharded), then
grows back to 3 when the node returns (torchrun's re-rendezvous on a new member, which
counts as no restart), and completes. Its own cluster, of three nodes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from cluster_jobs import NS, finished, one_trainer_per_node
from faults import assert_data_exactly_once, checkpointed, faulty_job, job_status, kept_history
from testcluster import ProcessCluster, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("elastic-cluster"), nodes=3) as running:
        running.install_operator(NS, seaweed.credentials(), secret="s3-creds")
        yield running


def _world_sizes(log: str) -> list[int]:
    return [int(size) for size in re.findall(r"rank 0 of world size (\d+)", log)]


# Enough steps that the shrunk gang is still training when the node's pod has started
# again and joined (16 steps at world size 2 alone here, more under load): a gang that
# finishes first restarts whole at 3 instead of growing.
STEPS = 45


def test_an_elastic_gang_shrinks_on_a_lost_node_and_grows_back(cluster, seaweed, reference):
    bucket, name = "faults-elastic", "elastic"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=STEPS)
    job["spec"]["trainer"] |= {"replicas": {"min": 2, "max": 3}}
    one_trainer_per_node(job)
    job["spec"]["scheduling"] = {"nodeLostSeconds": 5}
    cluster.apply(job)
    wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, every=0.5)
    lost = cluster.pod(NS, f"{name}-trainer-2")["spec"]["nodeName"]
    cluster.node(lost).lose()
    wait_for(lambda: not cluster.node_ready(lost), f"node {lost} to be marked lost", 60)

    def training_at(step: int) -> bool:
        status = job_status(cluster, name)
        return status.get("phase") == "Running" and (status.get("step") or 0) > step

    shrunk_from = job_status(cluster, name).get("step") or 0
    wait_for(lambda: training_at(shrunk_from + 2), "training on the nodes left", 300, every=1)
    cluster.node(lost).rejoin()
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    logs = "".join(cluster.logs(NS, f"{name}-trainer-{i}") for i in range(3))
    sizes = _world_sizes(logs)
    assert 2 in sizes and sizes[-1] == 3, sizes  # shrank, then grew back
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, STEPS)
