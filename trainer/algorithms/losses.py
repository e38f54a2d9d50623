"""Per-token policy-gradient losses and their global reduction.

Losses are returned per token; the reduction divides the *sum* over a micro-batch by a
normaliser computed over the whole optimizer batch (all micro-batches, all ranks), so
the accumulated gradient does not depend on how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each target token under softmax(logits / temperature)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of each position's sampling distribution."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy ‖ reference): unbiased and non-negative."""
    delta = ref_logp - logp
    return delta.exp() - delta - 1


@dataclass
class TokenLosses:
    loss: torch.Tensor
    """Per-token loss (same shape as the inputs)."""
    ratio: torch.Tensor
    """Importance ratio π/π_behaviour per token."""
    clipped: torch.Tensor
    """1.0 where the clipped branch was taken (the gradient is zero there)."""
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
) -> TokenLosses:
    """Clipped surrogate of PPO/GRPO per token, plus an optional k3 KL penalty.

    `advantages` is broadcast against the token dimension (one per sequence, shape
    [B, 1], or per token). The ratio is taken against the behaviour log-probs the rollout
    engine returned, never recomputed ones.
    """
    ratio = torch.exp(logp - behaviour_logp)
    unclipped = ratio * advantages
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_ratio * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float()
    kl = torch.zeros_like(logp)
    if ref_logp is not None and kl_coef > 0:
        kl = kl_k3(logp, ref_logp)
        loss = loss + kl_coef * kl
    return TokenLosses(loss=loss, ratio=ratio.detach(), clipped=was_clipped, kl=kl.detach())


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum()


def token_mean(losses: torch.Tensor, mask: torch.Tensor, global_tokens: float) -> torch.Tensor:
    """This micro-batch's share of the batch's token-mean: Σ(loss·mask) / global_tokens.

    `global_tokens` counts the valid tokens of the whole optimizer batch, so summing this
    over micro-batches (and ranks) gives exactly the token mean of the full batch.
    """
    if global_tokens <= 0:
        raise ValueError("global_tokens must be positive: the batch has no trainable tokens")
    return masked_sum(losses, mask) / global_tokens


def sft_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token (supervised fine-tuning)."""
    return -token_logprobs(logits, targets)
