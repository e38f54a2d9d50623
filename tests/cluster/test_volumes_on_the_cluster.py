"""A job whose model and data are on a PersistentVolume, not in the image: the claim is
mounted into the trainer and rollout pods through `spec.<role>.pod`, the process kubelet
maps it to the folder of the hostPath volume it is bound to, and the job trains from it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from cluster_jobs import ALGORITHMS, NS, finished, mount_a_claim, tiny_job
from testcluster import wait_for
from tiny_jobs import TINY_INIT

from rlft.trainer.config import DataSpec, ModelSpec
from rlft.trainer.data import build_task
from rlft.trainer.model.build import build_policy

CLAIM = "rlft-assets"


def _write_assets(folder: Path) -> None:
    """A Hugging Face model folder (the tiny model and its byte tokenizer) and arithmetic
    prompts as JSON Lines, as a user would put them on a volume."""
    spec = ModelSpec.model_validate({"init": TINY_INIT, "tokenizer": {"kind": "byte"}})
    model, tokenizer = build_policy(spec, [], seed=0)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    task = build_task(DataSpec.model_validate({"arithmetic": {"digits": 2}}), 0)
    rng = random.Random(0)
    (folder / "data").mkdir()
    with (folder / "data" / "train.jsonl").open("w") as train:
        for _ in range(500):
            problem = task.train_problem(rng)
            train.write(json.dumps({"prompt": problem.prompt, "answer": problem.answer}) + "\n")
    with (folder / "data" / "eval.jsonl").open("w") as held_out:
        for problem in task.eval_problems()[:20]:
            held_out.write(json.dumps({"prompt": problem.prompt, "answer": problem.answer}) + "\n")


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_a_job_whose_model_and_data_come_from_a_claim_succeeds(cluster, seaweed, tmp_path):
    """The pods' only copy of the model and the prompts is the claim, mounted read-only at
    /assets: the job reaches Succeeded, and nothing on the volume changed."""
    volume = tmp_path / "volume"
    volume.mkdir()
    _write_assets(volume)
    before = _files(volume)
    bucket, name = "volumes", "from-a-claim"
    seaweed.create_bucket(bucket)
    job = tiny_job(name, bucket, ALGORITHMS["grpo"])
    spec = job["spec"]
    spec["model"] = {"path": "/assets/model"}
    spec["data"] = {
        "source": "jsonl",
        "jsonl": {"train": "/assets/data/train.jsonl", "eval": "/assets/data/eval.jsonl"},
    }
    mount_a_claim(cluster, job, volume, CLAIM, "/assets")
    cluster.apply(job)
    done = wait_for(lambda: finished(cluster, name), f"{name} to finish", timeout=600, every=2)
    status = done["status"]
    logs = cluster.logs(NS, f"{name}-trainer-0") + cluster.logs(NS, f"{name}-trainer-1")
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1) + logs[-3000:]
    # The rollout pod started from the claim's model folder, before any publication.
    assert status.get("restarts", 0) == 0, json.dumps(status, indent=1)
    trainer = cluster.pod(NS, f"{name}-trainer-0")
    mounts = trainer["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "assets", "mountPath": "/assets", "readOnly": True} in mounts
    summary = seaweed.client().get_object(Bucket=bucket, Key=f"{name}/outputs/summary.json")
    assert json.loads(summary["Body"].read())["steps"] == spec["trainer"]["steps"]
    assert _files(volume) == before  # read-only: the pods wrote nothing there
