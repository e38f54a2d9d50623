"""What every objective shares: the models it trains, the forward pass (with MoE router
loss and expert load), and the clipped policy-gradient surrogate that grpo, rloo,
reinforce++ and ppo use. Each algorithm's own module (`grpo`, `ppo`, `dpo`, `sft`)
registers its objective in `registry`.

An objective computes, over one micro-batch: forward, per-token losses, and the
micro-batch's share of the batch loss (normalised by whole-batch counts).

An objective may run a no-grad `prepare` pass over a micro-batch before any update (old
log-probs for mismatch correction, the critic's values and GAE for PPO). `loss` returns
the tensor to backpropagate and plain sums for the step's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlft.trainer.algorithms.aggregation import Normalisers, aggregate, routed_tokens
from rlft.trainer.algorithms.batch import SequenceBatch
from rlft.trainer.algorithms.losses import (
    clipped_surrogate,
    importance_ratio,
    kl_estimate,
    mismatch_weights,
    token_logprobs,
    token_logprobs_and_entropy,
)
from rlft.trainer.algorithms.prefix import (
    completion_layout,
    completion_view,
    shared_prefix_logits,
)
from rlft.trainer.config.algorithm import AlgorithmSpec

Prepared = dict[str, torch.Tensor]
Sums = dict[str, float]

REJECTED_BY = {"truncate": "is_truncated", "mask": "is_masked"}
"""The sum of tokens whose mismatch weight was rejected, by `spec.mismatch.mode`."""


@dataclass
class Models:
    """What an objective trains: the policy and, for PPO, the critic."""

    policy: torch.nn.Module
    critic: torch.nn.Module | None = None


@dataclass
class Forward:
    logits: torch.Tensor
    aux_loss: torch.Tensor | None
    expert_tokens: torch.Tensor | None
    """Tokens routed to each expert, [layers, experts] (MoE models only)."""


def expert_count(config) -> int:
    """Experts per MoE layer (Qwen3-MoE's `num_experts`, Mixtral's `num_local_experts`);
    0 for dense models."""
    return getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0


def is_moe(model: torch.nn.Module) -> bool:
    return bool(expert_count(getattr(model, "config", None)))


def forward(model: torch.nn.Module, micro: SequenceBatch) -> Forward:
    """The model's logits; for MoE models also the router loss and per-expert load."""
    if not is_moe(model):
        out = model(input_ids=micro.input_ids, attention_mask=micro.attention_mask)
        return Forward(out.logits, None, None)
    out = model(
        input_ids=micro.input_ids, attention_mask=micro.attention_mask, output_router_logits=True
    )
    config = model.config
    experts = expert_count(config)
    top_k = config.num_experts_per_tok
    # The tokens the router loss weighs (`routed_tokens`): a filler row routes none.
    trains = micro.mask.sum(-1, keepdim=True) > 0
    attended = ((micro.attention_mask > 0) & trains).reshape(-1)
    counts = []
    for layer_logits in out.router_logits:
        chosen = layer_logits.detach().reshape(-1, experts)[attended].topk(top_k, dim=-1).indices
        counts.append(torch.bincount(chosen.reshape(-1), minlength=experts))
    return Forward(out.logits, out.aux_loss, torch.stack(counts).to(torch.float64))


def policy_forward(model: torch.nn.Module, micro: SequenceBatch) -> tuple[Forward, SequenceBatch]:
    """The policy's forward for a surrogate loss: each group's shared prompt read once,
    with the micro-batch in the completion layout (`prefix.py`), where that saves work;
    else the plain forward and the micro-batch as it is. MoE models (their router loss is
    per forward), activation checkpointing (it drops the cache) and FSDP-sharded models
    take the plain one: FSDP2 reshards a layer after its forward and unshards it again
    only for gradients that come back through the layer's output, while the prefix's
    gradient comes back through the cache."""
    if not is_moe(model) and not _checkpoints_activations(model) and not _sharded(model):
        layout = completion_layout(micro)
        if layout is not None:
            logits = shared_prefix_logits(model, micro, layout)
            return Forward(logits, None, None), completion_view(micro, layout)
    return forward(model, micro), micro


def _sharded(model: torch.nn.Module) -> bool:
    return hasattr(next(model.parameters()), "to_local")  # DTensor parameters


def _checkpoints_activations(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def router_term(fwd: Forward, micro: SequenceBatch, norms: Normalisers, coef: float):
    """The router loss weighted by this micro-batch's share of the batch's routed tokens,
    so its total weight is `coef` however the batch is split (a filler's share is 0)."""
    if fwd.aux_loss is None or coef == 0:
        return 0.0
    share = routed_tokens(micro.mask, micro.attention_mask) / norms.attended_tokens
    return coef * fwd.aux_loss * share


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, values, torch.zeros_like(values))


class PolicyGradient:
    """grpo, rloo and reinforce++: the clipped surrogate with precomputed advantages."""

    unit = 1
    shares_prompts = True
    """Read each group's prompt once (`policy_forward`); PPO's critic and GAE need the
    whole layout."""

    def __init__(self, spec: AlgorithmSpec, temperature: float, constant: float | None):
        self.spec = spec
        self.temperature = temperature
        self.constant = spec.policy_loss.constant_normalizer or constant

    @property
    def corrects_mismatch(self) -> bool:
        return self.spec.mismatch.mode != "none"

    def prepare(self, models: Models, micro: SequenceBatch) -> Prepared:
        if not self.corrects_mismatch:
            return {}
        fwd, micro = self._forward(models.policy, micro)
        return {"old_logp": token_logprobs(fwd.logits, micro.targets, self.temperature)}

    def _forward(self, model: torch.nn.Module, micro: SequenceBatch):
        if self.shares_prompts:
            return policy_forward(model, micro)
        return forward(model, micro), micro

    def advantages(self, micro: SequenceBatch, prepared: Prepared) -> torch.Tensor:
        return micro.advantages

    def loss(
        self, models: Models, micro: SequenceBatch, prepared: Prepared, norms: Normalisers
    ) -> tuple[torch.Tensor, Sums]:
        fwd, micro = self._forward(models.policy, micro)
        spec, mask = self.spec, micro.mask
        logp, entropy_per_token = token_logprobs_and_entropy(
            fwd.logits, micro.targets, self.temperature
        )
        weight = None
        rejected = torch.zeros_like(logp)
        anchor = micro.behaviour_logp
        if self.corrects_mismatch:
            anchor = prepared["old_logp"]
            m = spec.mismatch
            weight, rejected = mismatch_weights(
                anchor, micro.behaviour_logp, mask, m.mode, m.level, m.cap
            )
        pl = spec.policy_loss
        anchor = masked(anchor, mask)
        terms = clipped_surrogate(
            logp,
            anchor,
            self.advantages(micro, prepared),
            mask,
            pl.clip_low,
            pl.clip_high,
            pl.ratio_level,
            weight,
        )
        per_token = terms.loss
        kl = torch.zeros_like(logp)
        if spec.kl.coef > 0:
            # k3-ratio weights k3 by the surrogate's own ratio (same anchor and level, before
            # clipping, with gradient), as TRL's use_bias_correction_kl does.
            kl_ratio = None
            if spec.kl.estimator == "k3-ratio":
                kl_ratio = importance_ratio(logp, anchor, mask, pl.ratio_level)
            kl = kl_estimate(
                masked(logp, mask), masked(micro.ref_logp, mask), spec.kl.estimator, kl_ratio
            )
            if spec.kl.placement == "loss":
                per_token = per_token + spec.kl.coef * kl
        loss = aggregate(per_token, mask, pl.aggregation, norms, self.constant)
        loss = loss + router_term(fwd, micro, norms, spec.moe.router_aux_coef)
        ratio = terms.ratio[mask > 0]
        entropy = (entropy_per_token * mask).sum().item()
        sums = {
            "loss": loss.item(),
            "kl": (kl.detach() * mask).sum().item(),
            "entropy": entropy,
            "clip": (terms.clipped * mask).sum().item(),
            "ratio": ratio.sum().item(),
            "ratio_max": ratio.max().item() if ratio.numel() else float("-inf"),
            "ratio_min": ratio.min().item() if ratio.numel() else float("inf"),
            "is_weight": (terms.is_weight * mask).sum().item(),
            "is_rejected": (rejected * mask).sum().item(),
        }
        if weight is not None and spec.mismatch.mode != "none":
            # By what rejected them: the detector judges masking, the exporter shows both.
            sums[REJECTED_BY[spec.mismatch.mode]] = sums["is_rejected"]
        return loss, sums | expert_sums(fwd)


def count(value: float, what: str) -> float:
    if value <= 0:
        raise ValueError(f"the batch has no {what}")
    return value


def expert_sums(fwd: Forward) -> Sums:
    if fwd.expert_tokens is None:
        return {}
    return {
        f"expert_tokens.{layer}.{expert}": float(n)
        for layer, row in enumerate(fwd.expert_tokens.tolist())
        for expert, n in enumerate(row)
    }
