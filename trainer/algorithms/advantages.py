"""Critic-free advantage estimators."""

from __future__ import annotations

from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]


def group_relative_advantages(
    rewards: torch.Tensor, group_size: int, scale: Scale = "group", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a std.

    `rewards` is flat, groups contiguous (`group_size` completions of one prompt in a
    row). `scale`: divide by the group's std (GRPO), the whole batch's std, or not at all
    (Dr. GRPO). Stds are population stds; `eps` keeps all-equal groups at zero.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be flat with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    groups = rewards.reshape(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    # A group whose rewards are all equal carries no signal: make that exactly zero
    # rather than the mean's rounding error, which a std near zero would blow up.
    uniform = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    centred = centred.masked_fill(uniform, 0.0)
    if scale == "group":
        centred = centred / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std(unbiased=False) + eps)
    return centred.reshape(-1)
