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
from faults import assert_data_exactly_once, checkpointed, faulty_job, kept_history
from testcluster import ProcessCluster, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, seaweed) -> Iterator[ProcessCluster]:
    with ProcessCluster(tmp_path_factory.mktemp("elastic-cluster"), nodes=3) as running:
        running.install_operator(NS, seaweed.credentials(), secret="s3-creds")
        yield running


def _world_sizes(log: str) -> list[int]:
    return [int(size) for size in re.findall(r"rank 0 of world size (\d+)", log)]


STEPS = 14
"""Room for the first checkpoint, the node's loss, 2 steps on the nodes left and growing
back (the gang is lost a step or two after its first checkpoint, at step 2)."""
# The shrunk gang pauses after 2 steps (a planted `pause`, beating its liveness) until
# the node's pod has started again and joined: on a slow machine a gang that finished
# first restarted whole at 3 instead of growing.
PAUSE = {"kind": "pause", "worldSize": 2, "after": 2}


def test_an_elastic_gang_shrinks_on_a_lost_node_and_grows_back(cluster, seaweed, reference):
    bucket, name = "faults-elastic", "elastic"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=STEPS)
    job["spec"]["trainer"] |= {"replicas": {"min": 2, "max": 3}}
    one_trainer_per_node(job)
    job["spec"]["scheduling"] = {"nodeLostSeconds": 5}
    job["spec"]["trainer"]["env"] = [{"name": "RLFT_PLANT_FAULTS", "value": json.dumps([PAUSE])}]
    cluster.apply(job)
    wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, every=0.5)
    lost = cluster.pod(NS, f"{name}-trainer-2")["spec"]["nodeName"]
    cluster.node(lost).lose()
    wait_for(lambda: not cluster.node_ready(lost), f"node {lost} to be marked lost", 60)

    def paused() -> bool:
        return any(
            "of world size 2 pauses at step" in cluster.logs(NS, f"{name}-trainer-{i}")
            for i in range(2)
        )

    wait_for(paused, "2 steps trained on the nodes left", 300, every=1)
    cluster.node(lost).rejoin()
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    logs = "".join(cluster.logs(NS, f"{name}-trainer-{i}") for i in range(3))
    sizes = _world_sizes(logs)
    assert 2 in sizes and sizes[-1] == 3, sizes  # shrank, then grew back
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, STEPS)
