"""A node lost under a running job (its own test cluster: the node stays lost): its
kubelet and processes die and its heartbeats stop. The emulated node lifecycle controller
marks it Unknown and taints it; the job's pods there are evicted after
spec.scheduling.nodeLostSeconds, stay Terminating with no kubelet to finish them, and
the operator force-deletes them past their grace, so their slots are filled on the node
that is left and the job completes from its last checkpoint."""

from __future__ import annotations

import json

from cluster_jobs import NS, finished
from faults import assert_data_exactly_once, checkpointed, events, faulty_job, kept_history
from testcluster import wait_for


def test_a_lost_node_s_pods_are_replaced_on_the_node_left(cluster, seaweed, reference):
    bucket, name = "faults-node", "node-lost"
    seaweed.create_bucket(bucket)
    job = faulty_job(name, bucket, steps=16)
    job["spec"]["scheduling"] = {"nodeLostSeconds": 5}
    cluster.apply(job)
    saved = wait_for(lambda: checkpointed(cluster, name), "a committed checkpoint", 300, 0.5)
    victim = cluster.pod(NS, f"{name}-trainer-1")
    lost = victim["spec"]["nodeName"]
    cluster.node(lost).lose()
    wait_for(lambda: not cluster.node_ready(lost), f"node {lost} to be marked lost", 60)
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status["restarts"] >= 1
    reasons = [e["reason"] for e in events(cluster, name)]
    assert "ForceDeleted" in reasons, reasons
    for slot in ("trainer-0", "trainer-1"):
        pod = cluster.pod(NS, f"{name}-{slot}")
        assert pod is None or pod["spec"]["nodeName"] != lost, pod
    replaced = cluster.logs(NS, f"{name}-trainer-0") + cluster.logs(NS, f"{name}-trainer-1")
    resumed = int(replaced.split("resumed from the checkpoint of step ")[1].split()[0])
    assert resumed >= saved
    assert_data_exactly_once(kept_history(seaweed.client(), bucket, name), reference, 16)
