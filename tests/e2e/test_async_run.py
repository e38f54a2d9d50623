"""Whole jobs through `rlft train` with rollout servers as subprocesses: the async
pipeline (maxStaleness 2, two instances, weights by gloo broadcast) never trains on a
sample older than the limit, and maxStaleness 0 through a server is on-policy,
reproducible, and the synchronous in-process run step for step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rlft.trainer.cli.main import main

SPEC = {
    "model": {
        "init": {
            "family": "qwen3",
            "hiddenSize": 64,
            "numLayers": 2,
            "numHeads": 2,
            "numKvHeads": 2,
            "intermediateSize": 64,
            "maxPositionEmbeddings": 64,
        },
        "tokenizer": {"kind": "byte"},
    },
    "data": {"source": "arithmetic", "arithmetic": {"digits": 2, "evalSize": 16}},
    "algorithm": {"sft": {"steps": 20, "batchSize": 16, "warmupSteps": 1}, "groupSize": 4},
    "trainer": {"steps": 6, "promptsPerStep": 4, "microBatchSize": 16},
    "rollout": {"sampling": {"maxNewTokens": 4}, "local": "servers"},
    "eval": {"maxProblems": 16},
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def train(tmp_path: Path, name: str, spec_changes: dict | None = None, **rollout) -> list[dict]:
    spec = json.loads(json.dumps(SPEC)) | (spec_changes or {})
    spec["rollout"] |= rollout
    job = tmp_path / f"{name}.yaml"
    document = {"apiVersion": "rlft.dev/v1alpha1", "kind": "RLFineTune", "metadata": {"name": name}}
    job.write_text(yaml.safe_dump(document | {"spec": spec}))
    out = tmp_path / name
    assert main(["train", str(job), "--out", str(out)]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_run_with_two_instances_and_broadcast_stays_within_max_staleness(
    tmp_path: Path, monkeypatch
) -> None:
    # The broadcast group's address is the pod's IP, which the operator sets (loopback in
    # a pod is the pod's own); 127.0.0.7 is this machine's as well.
    monkeypatch.setenv("RLFT_POD_IP", "127.0.0.7")
    records = train(tmp_path, "async", instances=2, maxStaleness=2, publication="broadcast")
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert r["staleness_max"] <= 2
        assert r["stale_dropped"] == 0
        assert r["rollout_engines_healthy"] == 2 == r["rollout_engines_expected"]
        assert r["reissued_requests"] == 0
        assert 0.0 <= r["trainer_idle_ratio"] <= 1.0
        assert r["gen_tokens_per_s"] > 0
    assert max(r["staleness_max"] for r in records) >= 1  # it did run ahead
    # Publication runs in the background: the first one is certain to have finished once
    # a batch needed its weights, i.e. from step maxStaleness + 2 = 4 on (step 3's record
    # may still race the first broadcast).
    assert all(r["weight_publish_s"] > 0 for r in records[3:])
    versions = sorted((tmp_path / "async" / "weights").glob("v-*"))
    assert versions, "the first version is always written to the store (engines start from it)"


def test_max_staleness_zero_through_servers_is_on_policy_and_reproducible(tmp_path: Path) -> None:
    first = train(tmp_path, "sync-a", instances=1, maxStaleness=0)
    second = train(tmp_path, "sync-b", instances=1, maxStaleness=0)
    assert all(r["staleness_max"] == 0 and r["stale_dropped"] == 0 for r in first)
    keys = ("reward_mean", "loss", "grad_norm", "response_len_mean", "policy_version")
    assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in second]
    # on-policy: the engine's behaviour log-probs are the trainer's own (ratio 1 at epoch 1)
    ratios = [r["ratio_mean"] for r in first if "ratio_mean" in r]
    assert ratios and all(abs(ratio - 1.0) < 1e-4 for ratio in ratios)


def test_max_staleness_zero_through_a_server_is_the_in_process_synchronous_run(
    tmp_path: Path,
) -> None:
    # A format reward a barely-trained model sometimes earns, so the policy really changes
    # and the server has to follow every update to stay identical.
    changes = {"reward": {"functions": [{"name": "format"}]}}
    in_process = train(tmp_path, "in-process", changes, local="in-process", maxStaleness=0)
    served = train(tmp_path, "served", changes, instances=1, maxStaleness=0)
    assert any(r["update_applied"] and r["grad_norm"] > 0 for r in in_process)
    keys = ("reward_mean", "response_len_mean", "loss", "grad_norm", "policy_version")
    assert [[r[k] for k in keys] for r in served] == [[r[k] for k in keys] for r in in_process]
