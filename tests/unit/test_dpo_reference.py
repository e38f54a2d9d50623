"""DPO's reference log-probs are taken at the temperature of the policy's in the loss (1),
not at the rollout sampling temperature: a policy equal to its reference starts at
loss log 2 with margin 0. A real job's parts, learner and pair source, one step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tiny_jobs import TINY_MODEL

from rlft.trainer.algorithms import dpo
from rlft.trainer.algorithms.losses import token_logprobs
from rlft.trainer.algorithms.registry import algorithm
from rlft.trainer.config import parse_job
from rlft.trainer.distributed import Dist
from rlft.trainer.learner.learner import Learner
from rlft.trainer.run.loop import Run
from rlft.trainer.run.parts import build_parts
from rlft.trainer.run.sources import PairSource
from rlft.trainer.run.state import Cursor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PAIRS = 6


def _job(temperature: float):
    return parse_job(
        {
            "apiVersion": "rlft.dev/v1alpha1",
            "kind": "RLFineTune",
            "metadata": {"name": "tiny-dpo"},
            "spec": {
                "model": TINY_MODEL,
                "data": {"arithmetic": {"digits": 2, "evalSize": 20}},
                "algorithm": {"name": "dpo", "dpo": {"pairsPerStep": PAIRS}},
                "trainer": {"steps": 1, "microBatchSize": 4},
                "rollout": {"sampling": {"temperature": temperature, "maxNewTokens": 4}},
                "telemetry": {"enabled": False},
            },
        }
    )


def _run(temperature: float, tmp_path: Path) -> Run:
    """A run of the job as far as a pair source reads it: its parts, and a learner with
    the frozen reference (a copy of the policy, as before the first DPO step)."""
    job = _job(temperature)
    parts = build_parts(job)
    dist = Dist()
    learner = Learner(parts.policy, job.spec.trainer, dist)
    learner.freeze_reference()
    return Run(
        job=job,
        task=parts.task,
        encoder=parts.encoder,
        learner=learner,
        dist=dist,
        reporter=None,  # what a pair source's `next` does not read
        supervisor=None,
        checkpoints=None,
        cursor=Cursor(job.spec.trainer.seed),
        out=tmp_path,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_policy_equal_to_its_reference_starts_at_log_2(temperature, tmp_path) -> None:
    run = _run(temperature, tmp_path)
    drawn = PairSource().next(run, 1)
    sampling = run.spec.rollout.sampling
    objective = algorithm("dpo").objective(
        run.spec.algorithm, sampling.temperature, sampling.max_new_tokens
    )
    result = run.learner.step(objective, drawn.batch)
    assert result.applied and result.stats["norm_pairs"] == PAIRS
    assert result.stats["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert result.stats["margin"] == pytest.approx(0.0, abs=1e-5)


def test_the_reference_scores_at_the_temperature_of_the_loss(tmp_path) -> None:
    run = _run(0.7, tmp_path)
    batch = PairSource().next(run, 1).batch
    policy = run.learner.models.policy
    with torch.no_grad():
        logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    own = token_logprobs(logits, batch.targets, dpo.TEMPERATURE) * batch.mask
    torch.testing.assert_close(batch.ref_logp * batch.mask, own.to(batch.ref_logp.dtype))
