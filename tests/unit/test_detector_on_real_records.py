"""The collapse detector judges the records the trainer really writes: statistics from a
real objective's loss, through `update_metrics`, into `Detector.observe` and the
exporter. (The detector read `ratio_masked_fraction` and a scalar `expert_imbalance`
that no step ever wrote, and was tested only on hand-written records: both checks were
silently skipped in every run.)"""

from __future__ import annotations

import pytest
import torch
from tiny_jobs import float64_model

from rlft.trainer.algorithms.aggregation import Normalisers
from rlft.trainer.algorithms.batch import pack
from rlft.trainer.algorithms.objectives import Models, PolicyGradient
from rlft.trainer.config.algorithm import AlgorithmSpec
from rlft.trainer.learner.learner import StepResult
from rlft.trainer.run.step_metrics import update_metrics
from rlft.trainer.stability.detector import CRITICAL, OK, Detector
from rlft.trainer.telemetry.exporter import MetricsExporter

VOCAB = 40
EXPERTS = {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 16}


def step_record(model, algorithm: dict, behaviour_shift: float = 0.0) -> dict:
    """One step's record from a real loss: 4 completions of 2 prompts, whose behaviour
    log-probs are the policy's own, shifted by `behaviour_shift` (an engine whose
    numerics differ from the trainer's)."""
    spec = AlgorithmSpec.model_validate({"name": "grpo", "group_size": 2, **algorithm})
    objective = PolicyGradient(spec, 1.0, 5.0)
    prompts = [[3, 4, 5]] * 2 + [[6, 7]] * 2
    completions = [[11, 12, 13], [14, 15], [16, 17, 18], [19]]
    behaviour = [
        [x + behaviour_shift for x in own_logprobs(model, p, c)]
        for p, c in zip(prompts, completions, strict=True)
    ]
    advantages = [1.0, -1.0, 0.5, -0.5]
    batch = pack(prompts, completions, 0, behaviour, advantages).to(torch.float64)
    models = Models(model)
    norms = Normalisers.local(batch.mask, batch.attention_mask)
    with torch.no_grad():
        prepared = objective.prepare(models, batch)
    loss, sums = objective.loss(models, batch, prepared, norms)
    loss.backward()
    stats = sums | {"norm_tokens": norms.tokens, "norm_pairs": norms.pairs}  # as the learner
    return {"step": 1, **update_metrics(StepResult(stats=stats, grad_norm=1.0))}


def own_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
    return [logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def exported(record: dict) -> str:
    exporter = MetricsExporter()
    exporter.record(record)
    return exporter.exposition().decode()


def test_tokens_masked_for_their_mismatch_weight_are_judged_and_exported():
    model = float64_model("qwen3", VOCAB)
    masked = {"mismatch": {"mode": "mask", "cap": 2.0}}
    # Every behaviour log-prob 1 nat above the trainer's: weights e^-1 < 1/2, all masked.
    record = step_record(model, masked, behaviour_shift=1.0)
    assert record["ratio_masked_fraction"] == 1.0 == record["is_rejected_fraction"]
    assert "ratio_truncated_fraction" not in record
    verdict = Detector().observe(record)
    assert verdict.levels["importance_ratio_blowup"] == CRITICAL, verdict.reasons
    assert any("masked for extreme ratios" in r for r in verdict.reasons)
    assert "rlft_importance_ratio_masked_ratio 1.0" in exported(record)

    agreeing = step_record(model, masked, behaviour_shift=0.0)
    assert agreeing["ratio_masked_fraction"] == 0.0
    assert Detector().observe(agreeing).levels["importance_ratio_blowup"] == OK

    truncated = step_record(model, {"mismatch": {"mode": "truncate", "cap": 2.0}}, -1.0)
    assert truncated["ratio_truncated_fraction"] == 1.0
    assert "rlft_importance_ratio_truncated_ratio 1.0" in exported(truncated)


def test_a_collapsed_router_is_judged_and_exported():
    model = float64_model("qwen3-moe", VOCAB, **EXPERTS)
    healthy = step_record(model, {})
    assert healthy["expert_dead_fraction"] < 0.5
    with torch.no_grad():  # a router whose logits are all equal: the same experts always
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.zero_()
    record = step_record(model, {})
    assert record["expert_dead_fraction"] == 0.5  # two of four experts get no token
    assert record["expert_imbalance_max"] == 2.0
    verdict = Detector().observe(record)
    assert verdict.levels["expert_load_collapse"] == CRITICAL, verdict.reasons
    text = exported(record)
    assert "rlft_expert_dead_ratio 0.5" in text
    assert "rlft_expert_load_imbalance 2.0" in text


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_tokens_keep_their_place_in_the_token_mean(level):
    """MIS drops a term by giving it weight 0: it still counts in the loss's normaliser,
    as in TRL and prime-rl (verl takes it out of the response mask instead, which would
    make this loss 1/6). Row 0 (3 tokens, advantage 1) is rejected, the others train at
    ratio 1, each token's loss -advantage: (2·1 + 3·(-0.5) + 1·0.5) / 9 tokens."""
    model = float64_model("qwen3", VOCAB)
    spec = AlgorithmSpec.model_validate(
        {"name": "grpo", "group_size": 2, "mismatch": {"mode": "mask", "level": level}}
    )
    objective = PolicyGradient(spec, 1.0, 5.0)
    prompts = [[3, 4, 5]] * 2 + [[6, 7]] * 2
    completions = [[11, 12, 13], [14, 15], [16, 17, 18], [19]]
    behaviour = [own_logprobs(model, p, c) for p, c in zip(prompts, completions, strict=True)]
    behaviour[0] = [x + 1.0 for x in behaviour[0]]  # weights e^-1 < 1/cap: rejected
    batch = pack(prompts, completions, 0, behaviour, [1.0, -1.0, 0.5, -0.5]).to(torch.float64)
    models = Models(model)
    norms = Normalisers.local(batch.mask, batch.attention_mask)
    with torch.no_grad():
        prepared = objective.prepare(models, batch)
    loss, _ = objective.loss(models, batch, prepared, norms)
    assert norms.tokens == 9
    assert loss.item() == pytest.approx(1 / 9, abs=1e-6)  # 1/6 were they dropped
