"""Per-token and per-pair losses of every algorithm, as pure tensor functions.

Nothing here reduces over the batch: `aggregation.py` does that with normalisers counted
over the whole optimizer batch, so gradients do not depend on how the batch was split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

KLEstimator = Literal["k1", "k2", "k3", "k3-ratio"]


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each target token under softmax(logits / temperature)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and (without gradient) `token_entropy` from one log-softmax over
    the vocabulary, the costliest tensor of the loss."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of each position's sampling distribution."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: KLEstimator = "k3",
    ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """Schulman's per-token estimators of KL(policy ‖ reference), x = log π - log π_ref:
    k1 = x (unbiased, can be negative), k2 = x²/2, k3 = e^-x + x - 1 (unbiased, ≥ 0).

    `k3-ratio` is r·k3, with `ratio` r = π/π_old the clipped surrogate's importance ratio
    taken before clipping and kept in the graph: TRL's GRPOTrainer with
    `use_bias_correction_kl=True` (DeepSeek-V3.2's unbiased KL estimate). Where r = 1 its
    value is k3's but its gradient is ∇k3 + k3·∇log π. Over tokens sampled from π_old the
    expected gradient of r·k3 is ∇KL(π ‖ π_ref) per token; on-policy, k3's alone is
    ∇KL(π_ref ‖ π). `ratio` is read by k3-ratio only.
    """
    x = logp - ref_logp
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.exp(-x) + x - 1
    if estimator == "k3-ratio":
        if ratio is None:
            raise ValueError("the k3-ratio KL estimator needs the importance ratio π/π_old")
        return (torch.exp(-x) + x - 1) * ratio
    raise ValueError(f"unknown KL estimator {estimator!r}: use k1, k2, k3 or k3-ratio")


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(policy ‖ reference)."""
    return kl_estimate(logp, ref_logp, "k3")


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row's masked values, shape [B, 1]; rows without tokens give 0."""
    return (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


@dataclass
class PolicyTerms:
    """Per-token outputs of the clipped surrogate (all shaped like the log-probs)."""

    loss: torch.Tensor
    """Per-token loss; reduce it with `aggregation.aggregate`."""
    ratio: torch.Tensor
    """The importance ratio π/π_old, unclipped (per token, or the sequence's ratio on each
    token): what the metrics report; `clipped` says where the clip took over."""
    clipped: torch.Tensor
    """1.0 where the clipped branch was taken (no gradient flows there)."""
    is_weight: torch.Tensor
    """Train/inference mismatch weight applied to each term (1 without correction)."""
    is_rejected: torch.Tensor
    """1.0 where the mismatch weight was truncated (truncate: above cap) or masked (mask:
    above cap or below 1/cap)."""


def mismatch_weights(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["none", "truncate", "mask"],
    level: Literal["token", "sequence"],
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights π_old/π_behaviour correcting the rollout engine's numerics.

    `truncate` (TIS) caps the weight at `cap`; `mask` (MIS) zeroes terms whose weight
    exceeds `cap` or falls below 1/`cap`. `sequence` uses one weight per sequence: the
    product of its token weights. Returns (weights, rejected) without gradient.
    """
    log_w = torch.where(mask > 0, (old_logp - behaviour_logp).detach(), 0.0)
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(old_logp)
    if mode == "none":
        return torch.ones_like(log_w), torch.zeros_like(log_w)
    # Judged in log space and exponentiated only below the cap: a sequence's summed log
    # weight passes 88 nats (float32's exp overflows) on a long completion, and the
    # infinite weight of a rejected term times its zero made the whole step NaN.
    log_cap = math.log(cap)
    above = log_w > log_cap
    weight = torch.where(above, cap, torch.exp(log_w.clamp(max=log_cap)))
    if mode == "truncate":
        # TIS bounds the weight's variance from above only: a small weight already
        # shrinks its term, so there is nothing to truncate below.
        return weight, above.to(weight.dtype)
    if mode == "mask":
        # MIS trusts only terms where the engine and the trainer roughly agree: a weight
        # far below 1 means the engine sampled a token the trainer finds much less likely
        # (a numerics outlier just as much as one far above), so both tails are dropped.
        rejected = above | (log_w < -log_cap)
        return torch.where(rejected, 0.0, weight), rejected.to(weight.dtype)
    raise ValueError(f"unknown mismatch mode {mode!r}")


def importance_ratio(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    ratio_level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """π/π_old per token, unclipped and with its gradient; with `sequence` (GSPO) every
    token carries its sequence's exp(mean log-ratio). Masked tokens get 1 at token level and
    their sequence's ratio at sequence level: every use applies the mask."""
    log_ratio = (logp - old_logp) * mask
    if ratio_level == "sequence":
        log_ratio = sequence_mean(log_ratio, mask).expand_as(logp)
    return torch.exp(log_ratio)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ratio_level: Literal["token", "sequence"] = "token",
    is_weight: torch.Tensor | None = None,
) -> PolicyTerms:
    """PPO/GRPO's clipped surrogate -min(r·A, clip(r)·A) per token.

    `old_logp` is the policy the ratio is taken against: the behaviour log-probs the
    rollout engine returned (no mismatch correction) or the trainer's own log-probs before
    the update (with correction, whose weights come in `is_weight`). `ratio_level=sequence`
    is GSPO: r = exp(mean over the sequence's tokens of log π - log π_old), shared by all
    its tokens. `advantages` broadcasts against the tokens ([B, 1] or [B, T]).
    """
    ratio = importance_ratio(logp, old_logp, mask, ratio_level)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    weight = torch.ones_like(loss) if is_weight is None else is_weight
    return PolicyTerms(
        loss=loss * weight,
        ratio=ratio.detach(),
        clipped=(clipped < unclipped).to(loss.dtype),
        is_weight=weight.detach(),
        is_rejected=torch.zeros_like(loss),
    )


@dataclass
class TokenLosses:
    loss: torch.Tensor
    """Per-token loss."""
    ratio: torch.Tensor
    """Importance ratio π/π_behaviour per token."""
    clipped: torch.Tensor
    """1.0 where the clipped branch was taken."""
    kl: torch.Tensor
    """Per-token KL estimate to the reference (zeros without one)."""


def grpo_token_losses(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
) -> TokenLosses:
    """Token-level GRPO with an optional KL penalty (k3 by default) and no mismatch
    correction: the textbook case of `clipped_surrogate`, kept as a small API for
    hand-computed checks."""
    every_token = torch.ones_like(logp)
    terms = clipped_surrogate(logp, behaviour_logp, advantages, every_token, clip_low, clip_high)
    kl = torch.zeros_like(logp)
    loss = terms.loss
    if ref_logp is not None and kl_coef > 0:
        ratio = importance_ratio(logp, behaviour_logp, every_token)
        kl = kl_estimate(logp, ref_logp, kl_estimator, ratio)
        loss = loss + kl_coef * kl
    return TokenLosses(loss, terms.ratio, terms.clipped, kl.detach())


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's value loss ½·max((V - R)², (V_clip - R)²), V_clip within `clip` of V_old."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())


def preference_losses(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    beta: float,
    loss: Literal["sigmoid", "ipo"] = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO or IPO loss per pair, from each response's summed (DPO) or mean (IPO, as in
    its paper) log-probability. Returns (loss per pair, margin h = log-ratio difference)."""
    margin = (chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp)
    if loss == "sigmoid":
        pair_loss = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - (
            label_smoothing * F.logsigmoid(-beta * margin)
        )
    elif loss == "ipo":
        pair_loss = (margin - 1 / (2 * beta)).square()
    else:
        raise ValueError(f"unknown preference loss {loss!r}: use sigmoid or ipo")
    return pair_loss, margin.detach()


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def token_mean(losses: torch.Tensor, mask: torch.Tensor, global_tokens: float) -> torch.Tensor:
    """This micro-batch's share of the batch's token-mean: Σ(loss·mask) / global_tokens."""
    if global_tokens <= 0:
        raise ValueError("global_tokens must be positive: the batch has no trainable tokens")
    return masked_sum(losses, mask) / global_tokens


def sft_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token (supervised fine-tuning)."""
    return -token_logprobs(logits, targets)
