"""Advantage estimators: critic-free (GRPO, RLOO, REINFORCE++) and GAE for PPO, plus
DAPO's reward shaping and group filter. Pure functions over reward tensors."""

from __future__ import annotations

from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]


def group_relative_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale: Scale = "group",
    eps: float = 1e-6,
    sample_std: bool = False,
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a std.

    `rewards` is flat, groups contiguous (`group_size` completions of one prompt in a
    row). `scale`: divide by the group's std (GRPO), the whole batch's std, or not at all
    (Dr. GRPO). Stds are population stds, or with `sample_std` Bessel-corrected ones
    (TRL's); `eps` is added to them before dividing.
    """
    groups = _groups(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    # A group whose rewards are all equal carries no signal: make that exactly zero
    # rather than the mean's rounding error, which a std near zero would blow up.
    uniform = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    centred = centred.masked_fill(uniform, 0.0)
    if scale == "group":
        centred = centred / (groups.std(dim=1, unbiased=sample_std, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std(unbiased=sample_std) + eps)
    return centred.reshape(-1)


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be flat with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.reshape(-1, group_size)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each reward minus the mean of the *other* rewards of its group."""
    if group_size < 2:
        raise ValueError("RLOO needs at least 2 completions per prompt")
    groups = _groups(rewards, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1)


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ (with baseline): subtract the group mean when there are groups, then
    whiten over the whole batch (its mean and population std)."""
    centred = rewards
    if group_size > 1:
        groups = _groups(rewards, group_size)
        centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    return (centred - centred.mean()) / (centred.std(unbiased=False) + eps)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each row's masked (contiguous) tokens.

    The value after the last token is 0 (the episode ends). Returns (advantages,
    returns = advantages + values), zero outside the mask.
    """
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m > 0, delta + gamma * lam * running, running)
        next_value = torch.where(m > 0, values[:, t], next_value)
        advantages[:, t] = running * m
    return advantages, (advantages + values) * mask


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int, penalty: float):
    """DAPO's soft overlong penalty: 0 up to max - buffer tokens, then linearly down to
    -penalty at max tokens."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float64)
    start = max_tokens - buffer
    excess = (lengths.to(torch.float64) - start).clamp(min=0, max=buffer)
    return -penalty * excess / buffer


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True for groups whose rewards are not all equal."""
    groups = _groups(rewards, group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)
