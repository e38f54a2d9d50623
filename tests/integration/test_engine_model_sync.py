"""Rank 0's unsharded engine model (what samples, evaluates and is saved) is gathered from
the sharded policy only when something uses it, not after every update: an update leaves
it behind, `refresh_engine_model` brings it level. On a real 2-rank gloo group (torchrun,
FSDP2); in one process the engine is the policy itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from processes import private_tmp
from tiny_jobs import TINY_INIT, arithmetic_rl_spec, manifest, write_parity_job
from transformers import AutoModelForCausalLM

from rlft.trainer.algorithms.registry import build_objective
from rlft.trainer.config import parse_job
from rlft.trainer.distributed import Dist
from rlft.trainer.distributed.launch import worker_env
from rlft.trainer.learner.learner import Learner
from rlft.trainer.model.construct import from_pretrained
from rlft.trainer.verify.check import prepare

WORKER = """
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from rlft.trainer.model.construct import from_pretrained
from rlft.trainer.algorithms.registry import build_objective
from rlft.trainer.config import parse_job
from rlft.trainer.distributed.runtime import exit_worker, init_from_env, shutdown
from rlft.trainer.learner.learner import Learner

folder = Path(sys.argv[1])
job = parse_job(json.loads((folder / "job.json").read_text()))
dist = init_from_env()
learner = Learner(from_pretrained(AutoModelForCausalLM, folder / "policy"), job.spec.trainer, dist)
batch = torch.load(folder / "batch.pt", weights_only=False)
spec = job.spec
objective = build_objective(spec.algorithm, spec.rollout.sampling.temperature, 4)


def engine_gap() -> float:
    full = learner.full_policy_state()  # collective
    if not dist.is_main:
        return 0.0
    engine = learner.engine_model.state_dict()
    return max((engine[k] - v).abs().max().item() for k, v in full.items())


found = {"current_at_start": learner.engine_current, "gap_at_start": engine_gap()}
for _ in range(2):
    learner.step(objective, batch)
found |= {"current_after_steps": learner.engine_current, "gap_after_steps": engine_gap()}
learner.refresh_engine_model()
found |= {"current_after_refresh": learner.engine_current, "gap_after_refresh": engine_gap()}
if dist.is_main:
    (folder / "found.json").write_text(json.dumps(found))
shutdown()
exit_worker(0)
"""


def _job(tmp_path: Path, monkeypatch):
    """The tiny GRPO job with the parity reward (every group has signal), its policy and
    a batch of its rollouts in `tmp_path`."""
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, init=TINY_INIT)
    write_parity_job(tmp_path, spec)
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = manifest(spec)
    (tmp_path / "job.json").write_text(json.dumps(raw))
    job = parse_job(raw)
    prepare(job, tmp_path, sequences=8)
    return job


def test_an_update_leaves_rank_0s_engine_behind_until_it_is_refreshed(tmp_path, monkeypatch):
    _job(tmp_path, monkeypatch)
    (tmp_path / "worker.py").write_text(WORKER)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(tmp_path / "worker.py"), str(tmp_path)]
    env = worker_env(2) | {"TMPDIR": str(private_tmp(tmp_path / "tmp"))}  # torchelastic_*
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((tmp_path / "found.json").read_text())
    assert found["current_at_start"] and found["gap_at_start"] == 0.0, found
    # Two updates, no gather: the engine still holds the weights it started with.
    assert not found["current_after_steps"] and found["gap_after_steps"] > 1e-6, found
    assert found["current_after_refresh"] and found["gap_after_refresh"] == 0.0, found


def test_in_one_process_the_engine_is_the_policy_and_always_current(tmp_path, monkeypatch):
    job = _job(tmp_path, monkeypatch)
    policy = from_pretrained(AutoModelForCausalLM, tmp_path / "policy")
    learner = Learner(policy, job.spec.trainer, Dist())
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    objective = build_objective(job.spec.algorithm, job.spec.rollout.sampling.temperature, 4)
    learner.step(objective, torch.load(tmp_path / "batch.pt", weights_only=False))
    assert learner.engine_model is policy
    assert learner.engine_current
    assert any(not torch.equal(before[k], v) for k, v in policy.state_dict().items())
