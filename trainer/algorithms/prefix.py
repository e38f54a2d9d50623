"""A forward pass that reads each group's shared prompt once.

GRPO-style batches hold `groupSize` completions of every prompt in consecutive rows, so
most of a row's positions (the prompt) are the same as its neighbours'. Instead of the
whole [rows, columns] batch, the model reads each distinct prompt once and keeps its
key/value cache, copied to the rows of the group, then reads every row's completion on
top of it. The loss needs only the positions that predict completion tokens, so the
result is laid out by completion position: column j of row i is row i's j-th trained
position (the last prompt token predicts the first completion token).

Mathematically the logits and the gradient are those of the full forward (the prompt's
activations receive the summed gradient of its rows); numerically they agree to rounding
(tests/unit/test_shared_prefix.py). With 8 completions of 5 tokens on 8-token prompts it
reads 1536 positions instead of 3072.

Only the last column of the prompt is re-read with the completion; what comes before it
is the shared prefix. Rows without a prefix to share (one-token prompts, the filler rows
of `empty_like`) simply have an empty one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields

import torch

from rlft.trainer.algorithms.batch import SequenceBatch


@dataclass(frozen=True)
class CompletionLayout:
    """Where a micro-batch's shared prefixes and trained positions are."""

    first: torch.Tensor
    """[B] column of each row's first trained position (its prefix is columns 0..first-1)."""
    group: torch.Tensor
    """[B] index of the row's prefix group (consecutive rows with the same prefix)."""
    leaders: torch.Tensor
    """[G] the first row of each group."""
    index: torch.Tensor
    """[B, C] the batch column of each completion-layout column (clamped to the batch)."""
    valid: torch.Tensor
    """[B, C] True where the column is an attended position of the row."""


def completion_layout(micro: SequenceBatch) -> CompletionLayout | None:
    """The layout, or None when no two consecutive rows share a prefix (nothing to gain)."""
    rows, width = micro.input_ids.shape
    if rows < 2:
        return None
    trained = micro.mask > 0
    first = torch.where(trained.any(-1), trained.int().argmax(-1), 0)
    columns = torch.arange(width)
    same_tokens = (micro.input_ids[1:] == micro.input_ids[:-1]) | (columns >= first[1:, None])
    same = (first[1:] == first[:-1]) & same_tokens.all(-1) & (first[1:] > 0)
    if not bool(same.any()):
        return None
    starts = torch.cat([torch.ones(1, dtype=torch.bool), ~same])
    group = starts.long().cumsum(0) - 1
    ends = micro.attention_mask.sum(-1)
    span = int((ends - first).max().clamp(min=1))
    index = first[:, None] + torch.arange(span)
    valid = index < ends[:, None]
    return CompletionLayout(
        first=first,
        group=group,
        leaders=torch.nonzero(starts).squeeze(-1),
        index=index.clamp(max=width - 1),
        valid=valid,
    )


def completion_view(micro: SequenceBatch, layout: CompletionLayout) -> SequenceBatch:
    """The micro-batch's per-position fields in the completion layout ([B, C]); columns
    past a row's end are padding (zero weight, attention 0)."""

    def take(name: str) -> torch.Tensor:
        values = getattr(micro, name).gather(1, layout.index)
        return torch.where(layout.valid, values, torch.zeros_like(values))

    return SequenceBatch(**{f.name: take(f.name) for f in fields(SequenceBatch)})


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword a transformers model takes its KV cache by (renamed during 5.x)."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def shared_prefix_logits(
    model: torch.nn.Module, micro: SequenceBatch, layout: CompletionLayout
) -> torch.Tensor:
    """Logits [B, C, vocab] of the completion layout's positions: each group's prefix
    read once (left-padded so that all prefixes end at the same column), its cache
    copied to the group's rows, then every row's trained positions read on top."""
    leaders = layout.leaders
    lengths = layout.first[leaders]
    prefix_width = int(lengths.max())
    groups = len(leaders)
    prefix_ids = torch.zeros((groups, prefix_width), dtype=micro.input_ids.dtype)
    prefix_mask = torch.zeros((groups, prefix_width), dtype=micro.attention_mask.dtype)
    source = micro.input_ids[leaders]
    for g, length in enumerate(lengths.tolist()):
        if length:
            prefix_ids[g, prefix_width - length :] = source[g, :length]
            prefix_mask[g, prefix_width - length :] = 1
    cache_arg = cache_argument(model)
    prefix = model(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = getattr(prefix, cache_arg)
    cache.batch_select_indices(layout.group)
    ids = micro.input_ids.gather(1, layout.index)
    ids = torch.where(layout.valid, ids, torch.zeros_like(ids))
    attention = torch.cat([prefix_mask[layout.group], layout.valid.to(prefix_mask.dtype)], 1)
    positions = layout.first[:, None] + torch.arange(ids.shape[1])
    out = model(
        input_ids=ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        **{cache_arg: cache},
    )
    return out.logits
