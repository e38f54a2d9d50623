"""One step's figures for metrics.jsonl (and, through the bindings, Prometheus): from the
rollouts, and from the summed statistics of the update."""

from __future__ import annotations

import hashlib
import json

import torch

from rlft.trainer.learner.learner import StepResult


def data_digest(prompts: list) -> str:
    """A short fingerprint of the prompts a step trained on, in order (token ids or
    encoded prompts): the kept history of a resumed run has the same sequence as an
    uninterrupted run of the job, which is how "each prompt trained once" is checked."""
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def rollout_metrics(rollouts) -> dict[str, float]:
    rewards = rollouts.rewards.to(torch.float64)
    completions = rollouts.completions
    lengths = [len(c.token_ids) for c in completions] or [0]
    out = {
        "reward_mean": rewards.mean().item() if rewards.numel() else float("nan"),
        "reward_std": rewards.std(unbiased=False).item() if rewards.numel() else float("nan"),
        "train_accuracy": rollouts.accuracy,
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "truncated_fraction": sum(c.finish_reason == "length" for c in completions)
        / max(1, len(completions)),
    }
    return out | rollouts.stats


def update_metrics(result: StepResult) -> dict[str, float]:
    """Per-step averages from the summed statistics of the update."""
    stats = result.stats
    tokens = max(stats.get("norm_tokens", 0.0), 1.0)
    pairs = max(stats.get("norm_pairs", 0.0), 1.0)
    out: dict[str, float] = {"update_applied": result.applied, "guard_action": result.action}
    if not result.applied:
        out["skip_reason"] = result.reason
        if not stats:
            return out
    out["loss"] = stats.get("loss", float("nan"))
    out["grad_norm"] = result.grad_norm
    if result.group_norms:
        out["grad_norm_groups"] = result.group_norms
    if result.applied:  # rlft_trained_tokens_total: a skipped update trained on none
        out["tokens"] = stats.get("norm_tokens", 0.0)
    if result.dropped_epochs:
        out["dropped_epochs"] = result.dropped_epochs
    if result.critic_grad_norm is not None:
        out["critic_grad_norm"] = result.critic_grad_norm
    if result.critic_skipped_epochs:
        out["critic_skipped_epochs"] = result.critic_skipped_epochs
    for key in ("kl", "entropy", "is_weight"):
        if key in stats:
            out[key if key != "is_weight" else "is_weight_mean"] = stats[key] / tokens
    if "clip" in stats:
        out["clip_fraction"] = stats["clip"] / tokens
        out["ratio_mean"] = stats["ratio"] / tokens
        out["ratio_max"] = stats["ratio_max"]
        out["ratio_min"] = stats["ratio_min"]
        out["is_rejected_fraction"] = stats["is_rejected"] / tokens
        for key, name in (
            ("is_truncated", "ratio_truncated_fraction"),
            ("is_masked", "ratio_masked_fraction"),
        ):
            if key in stats:
                out[name] = stats[key] / tokens
    if "value_loss" in stats:
        out["value_loss"] = stats["value_loss"]
    if "margin" in stats:
        out["margin_mean"] = stats["margin"] / pairs
        out["preference_accuracy"] = stats["preference_accuracy"] / pairs
    return out | expert_metrics(stats)


DEAD_SHARE = 0.01
"""An expert given under this fraction of an even share of its layer's tokens is unused."""


def expert_metrics(stats: dict[str, float]) -> dict[str, float | list[float]]:
    """MoE load: tokens per expert per layer → imbalance (max / mean load) per layer, the
    worst layer's imbalance and its fraction of unused experts (what the detector judges)."""
    loads: dict[int, dict[int, float]] = {}
    for key, value in stats.items():
        if key.startswith("expert_tokens."):
            _, layer, expert = key.split(".")
            loads.setdefault(int(layer), {})[int(expert)] = value
    if not loads:
        return {}
    imbalance, dead, per_layer = [], [], []
    for layer in sorted(loads):
        counts = [loads[layer][e] for e in sorted(loads[layer])]
        mean = sum(counts) / len(counts)
        imbalance.append(max(counts) / mean if mean > 0 else float("nan"))
        dead.append(sum(c < DEAD_SHARE * mean for c in counts) / len(counts))
        total = sum(counts) or 1.0
        per_layer.append([c / total for c in counts])
    return {
        "expert_imbalance_max": max(imbalance),
        "expert_dead_fraction": max(dead),
        "expert_imbalance": imbalance,
        "expert_load": per_layer,
    }
