"""Reducing per-token losses with normalisers counted over the whole optimizer batch.

A micro-batch's contribution is its *sum* divided by a count of the whole batch (every
micro-batch on every rank), so the sum of contributions — which is what gradient
accumulation and the data-parallel reduction compute — is exactly the batch's loss.
Dividing by a micro-batch's own count instead is the bug that makes updates depend on
micro-batching, padding and world size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from rlft.trainer.config.algorithm import Aggregation


@dataclass(frozen=True)
class Normalisers:
    """Counts over the whole optimizer batch (all micro-batches, all ranks)."""

    tokens: float
    """Trainable (masked-in) tokens."""
    sequences: float
    """Sampled sequences, also those left without a trainable token (overlong filtering
    masks a truncated one out): each counts, as TRL counts its rows, so Dr. GRPO's
    `constant` normaliser stays constant however many completions were filtered."""
    attended_tokens: float = 0.0
    """Non-padding input tokens (prompt and completion) of the sequences that train: the
    MoE router loss's weight (`routed_tokens`)."""
    pairs: float = 0.0
    """Preference pairs (DPO)."""

    @classmethod
    def local(cls, mask: torch.Tensor, attention_mask: torch.Tensor, pairs: int = 0):
        """This shard's counts (its rows are samples: a rank short of micro-batches adds
        filler ones outside it), to be summed across ranks (`all_reduce`) before use."""
        return cls(
            tokens=float(mask.sum().item()),
            sequences=float(mask.shape[0]),
            attended_tokens=float(routed_tokens(mask, attention_mask).item()),
            pairs=float(pairs),
        )

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(list(asdict(self).values()), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> Normalisers:
        return cls(*(float(v) for v in values.tolist()))


def routed_tokens(mask: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Attended tokens of the rows with a trainable token. A rank short of micro-batches
    runs filler rows (`empty_like`: one attended token, nothing to train) to stay in step
    with the others' collectives; counting them would give the router loss of a filler a
    weight, and so the gradient a dependence on how many ranks ran short."""
    trains = (mask.sum(-1, keepdim=True) > 0).to(attention_mask.dtype)
    return (attention_mask * trains).sum()


def aggregate(
    losses: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    norms: Normalisers,
    constant: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the batch loss under `mode`.

    - `token-mean`: Σ loss / all tokens of the batch.
    - `seq-mean-token-sum`: Σ per-sequence sums / sequences of the batch.
    - `seq-mean-token-mean`: Σ per-sequence means / sequences of the batch.
    - `constant` (Dr. GRPO): Σ loss / (sequences of the batch × `constant`).
    """
    masked = losses * mask
    if mode == "token-mean":
        return masked.sum() / _positive(norms.tokens, "tokens")
    sequences = _positive(norms.sequences, "sequences")
    if mode == "seq-mean-token-sum":
        return masked.sum() / sequences
    if mode == "seq-mean-token-mean":
        per_sequence = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_sequence.sum() / sequences
    if mode == "constant":
        if constant is None or constant <= 0:
            raise ValueError("`constant` aggregation needs a positive constant normaliser")
        return masked.sum() / (sequences * constant)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def _positive(count: float, what: str) -> float:
    if count <= 0:
        raise ValueError(f"the batch has no trainable {what}: nothing to normalise by")
    return count
