"""The update does not depend on how the batch is split: for every algorithm and every
loss aggregation, the gradient of (1 process, 1 micro-batch), (1 process, 4 micro-batches),
(2 gloo ranks with FSDP2, 2 micro-batches each) and the same batch with extra padding
agree to 1e-12 relative error in float64 (float64 rounding,
1e-15, where a float32 step anywhere would show as 1e-8: `model/build.py`'s
`float64_rms_norms`). Real multi-process gloo groups (torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_jobs import MOE_INIT, TINY_INIT, manifest

from rlft.trainer.config import parse_job
from rlft.trainer.learner.gradients import Faults
from rlft.trainer.verify.check import compare, local_gradients, prepare, run_cases, write_case

TOLERANCE = 1e-12
TINY, MOE = TINY_INIT, MOE_INIT

# name -> (algorithm section, model init, sequences)
CASES: dict[str, tuple[dict, dict, int]] = {
    "grpo-token-mean": ({"name": "grpo", "groupSize": 4}, TINY, 16),
    "grpo-seq-mean-token-sum": (
        {"name": "grpo", "groupSize": 4, "policyLoss": {"aggregation": "seq-mean-token-sum"}},
        TINY,
        16,
    ),
    "grpo-seq-mean-token-mean": (
        {"name": "grpo", "groupSize": 4, "policyLoss": {"aggregation": "seq-mean-token-mean"}},
        TINY,
        16,
    ),
    "dr-grpo-constant": (
        {
            "name": "grpo",
            "groupSize": 4,
            "scaleRewards": "none",
            "policyLoss": {"aggregation": "constant"},
        },
        TINY,
        16,
    ),
    "dapo": (
        {
            "name": "grpo",
            "groupSize": 4,
            "policyLoss": {"clipLow": 0.2, "clipHigh": 0.28},
            "overlong": {"softPenaltyTokens": 3},
        },
        TINY,
        16,
    ),
    "gspo": (
        {
            "name": "grpo",
            "groupSize": 4,
            "policyLoss": {
                "ratioLevel": "sequence",
                "aggregation": "seq-mean-token-mean",
                "clipLow": 0.05,
                "clipHigh": 0.06,
            },
        },
        TINY,
        16,
    ),
    "rloo": ({"name": "rloo", "groupSize": 4}, TINY, 16),
    "reinforce++": ({"name": "reinforce++", "groupSize": 2}, TINY, 16),
    "kl-k1-loss": (
        {"name": "grpo", "groupSize": 4, "kl": {"coef": 0.1, "estimator": "k1"}},
        TINY,
        16,
    ),
    "kl-k2-loss": (
        {"name": "grpo", "groupSize": 4, "kl": {"coef": 0.1, "estimator": "k2"}},
        TINY,
        16,
    ),
    "kl-k3-ratio-loss": (
        {"name": "grpo", "groupSize": 4, "kl": {"coef": 0.1, "estimator": "k3-ratio"}},
        TINY,
        16,
    ),
    "kl-k3-reward": (
        {"name": "grpo", "groupSize": 4, "kl": {"coef": 0.1, "placement": "reward"}},
        TINY,
        16,
    ),
    "tis-token": (
        {"name": "grpo", "groupSize": 4, "mismatch": {"mode": "truncate", "cap": 1.5}},
        TINY,
        16,
    ),
    "mis-sequence": (
        {
            "name": "grpo",
            "groupSize": 4,
            "mismatch": {"mode": "mask", "level": "sequence", "cap": 3.0},
        },
        TINY,
        16,
    ),
    "ppo": (
        {
            "name": "ppo",
            "groupSize": 2,
            "kl": {"coef": 0.05, "placement": "reward"},
            "ppo": {"lam": 0.9, "gamma": 0.99},
        },
        TINY,
        16,
    ),
    "dpo": ({"name": "dpo"}, TINY, 16),
    "ipo": ({"name": "dpo", "dpo": {"loss": "ipo", "beta": 0.5}}, TINY, 16),
    "sft-uneven": ({"name": "sft"}, TINY, 14),
    "mixtral-grpo": (
        {"name": "grpo", "groupSize": 4},
        MOE | {"family": "mixtral"},
        16,
    ),
    "moe-gspo": (
        {
            "name": "grpo",
            "groupSize": 4,
            "policyLoss": {"ratioLevel": "sequence", "aggregation": "seq-mean-token-mean"},
        },
        MOE,
        16,
    ),
}


def job_for(algorithm: dict, init: dict):
    return parse_job(
        manifest(
            {
                "model": {"init": init, "tokenizer": {"kind": "byte"}},
                "data": {"arithmetic": {"digits": 2, "evalSize": 10}},
                "algorithm": algorithm | {"sft": {"steps": 0}},
                "rollout": {"sampling": {"maxNewTokens": 5}},
            },
            "invariance",
        )
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    out = {}
    for name, (algorithm, init, sequences) in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        job = job_for(algorithm, init)
        prepare(job, folder, sequences)
        out[name] = (job, folder)
    return out


@pytest.fixture(scope="module")
def two_rank_gradients(prepared) -> dict[str, dict]:
    """All cases in one torchrun launch of 2 gloo ranks (FSDP2, 2 micro-batches each)."""
    cases = [write_case(job, folder, 2, name="two-ranks") for job, folder in prepared.values()]
    return dict(zip(prepared, run_cases(2, cases), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_is_invariant_to_micro_batching_world_size_and_padding(
    name, prepared, two_rank_gradients
) -> None:
    job, folder = prepared[name]
    reference = local_gradients(job, folder, micro_batches=1)
    assert max(g.abs().max().item() for g in reference.values()) > 0, "zero gradient tests nothing"
    variants = {
        "1 process × 4 micro-batches": local_gradients(job, folder, micro_batches=4),
        "1 process, 9 extra padding columns": local_gradients(
            job, folder, micro_batches=2, pad_to=_width(folder) + 9
        ),
        "2 ranks × 2 micro-batches (FSDP2)": two_rank_gradients[name],
    }
    for label, grads in variants.items():
        errors = compare(reference, grads)
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOLERANCE, f"{name}, {label}: {worst} off by {errors[worst]:.2e}"


def _width(folder: Path) -> int:
    import torch

    return torch.load(folder / "batch.pt", weights_only=False).input_ids.shape[1]


def test_moe_router_loss_is_independent_of_world_size(tmp_path) -> None:
    """The router loss is a per-forward statistic, so it is compared at equal micro-batch
    composition: 1 process × 4 micro-batches vs 2 ranks × 2 (the same four slices)."""
    job = job_for({"name": "grpo", "groupSize": 4, "moe": {"routerAuxCoef": 0.05}}, MOE)
    prepare(job, tmp_path, 16)
    single = local_gradients(job, tmp_path, micro_batches=4)
    (two,) = run_cases(2, [write_case(job, tmp_path, 2, name="two")])
    errors = compare(single, two)
    assert max(errors.values()) < TOLERANCE
    no_aux = job_for({"name": "grpo", "groupSize": 4}, MOE)
    differs = compare(single, local_gradients(no_aux, tmp_path, micro_batches=4))
    assert max(differs.values()) > 1e-4, "the router loss had no effect on the gradient"


def _gradients_of_rank_slices(job, folder: Path, world: int, micro_batches: int) -> dict:
    """In one process, the gradient `world` ranks compute with `micro_batches` each: every
    rank's own micro-batches (the same slices, so the same router-loss forwards), the
    whole batch's normalisers, and no filler micro-batches."""
    import dataclasses
    import math

    import torch

    from rlft.trainer.algorithms.aggregation import Normalisers
    from rlft.trainer.algorithms.batch import rank_shard
    from rlft.trainer.algorithms.registry import build_objective
    from rlft.trainer.distributed import Dist
    from rlft.trainer.learner.gradients import backward, full_gradients, plan_step
    from rlft.trainer.verify.check import _load_models

    sampling = job.spec.rollout.sampling
    objective = build_objective(job.spec.algorithm, sampling.temperature, sampling.max_new_tokens)
    models = _load_models(folder, Dist(), job)
    batch = torch.load(folder / "batch.pt", weights_only=False)
    whole = Normalisers.local(batch.mask, batch.attention_mask)
    for rank in range(world):
        shard = rank_shard(batch, rank, world)
        size = math.ceil(len(shard) / micro_batches)
        plan = plan_step(objective, models, shard, batch, size, Dist())
        backward(objective, models, dataclasses.replace(plan, norms=whole), Dist())
    return full_gradients(models.policy)


def test_moe_router_loss_ignores_the_filler_of_a_rank_with_fewer_micro_batches(tmp_path) -> None:
    """9 sequences on 2 ranks, 4 micro-batches each: rank 0's 5 make 3 micro-batches of
    2, 2 and 1, rank 1's 4 make 4, so rank 0 runs a filler to stay in step. Its router
    loss had the weight of one token: the gradient depended on the ranks' split."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlft.trainer.model.construct import from_pretrained

    job = job_for({"name": "grpo", "groupSize": 3, "moe": {"routerAuxCoef": 0.05}}, MOE)
    prepare(job, tmp_path, 9)
    # A filler row holds token 0, whose embedding a model built here has at zero (its pad
    # token's); a pretrained model's has not, and that gives its router loss a gradient.
    policy = from_pretrained(AutoModelForCausalLM, tmp_path / "policy")
    with torch.no_grad():
        policy.get_input_embeddings().weight[0] = policy.get_input_embeddings().weight[7]
    policy.save_pretrained(tmp_path / "policy")
    (two,) = run_cases(2, [write_case(job, tmp_path, 4, name="uneven")])
    errors = compare(_gradients_of_rank_slices(job, tmp_path, 2, 4), two)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOLERANCE, f"{worst} off by {errors[worst]:.2e}"
    # Nor does a filler count in the expert-load metrics (it added a token per filler).
    from rlft.trainer.algorithms.batch import empty_like
    from rlft.trainer.algorithms.objectives import forward
    from rlft.trainer.distributed import Dist
    from rlft.trainer.verify.check import _load_models

    batch = torch.load(tmp_path / "batch.pt", weights_only=False)
    policy = _load_models(tmp_path, Dist(), job).policy
    assert forward(policy, empty_like(batch)).expert_tokens.sum() == 0
    assert forward(policy, batch.slice(0, 1)).expert_tokens.sum() == 2 * 2 * 10  # k·layers·T


def test_planted_bugs_are_caught(prepared) -> None:
    """The two classic bugs, planted on purpose, move the gradient far beyond tolerance."""
    job, folder = prepared["grpo-token-mean"]
    reference = local_gradients(job, folder)
    cases = [
        write_case(job, folder, 4, Faults(per_micro_batch_normaliser=True), name="bug-norm"),
        write_case(job, folder, 4, Faults(drop_last_micro_batch=True), name="bug-drop"),
    ]
    for grads in run_cases(2, cases):
        assert max(compare(reference, grads).values()) > 1e-2
