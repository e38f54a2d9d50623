"""Packing prompt+completion sequences into padded tensors for the trainer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceBatch:
    """Right-padded sequences; position t of `targets`/`mask`/`behaviour_logp` describes
    the token predicted from position t of `input_ids` (i.e. token t+1)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    """1.0 on completion tokens that are trained on."""
    behaviour_logp: torch.Tensor
    advantages: torch.Tensor
    """One per sequence, shape [B, 1]."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> SequenceBatch:
        return SequenceBatch(
            **{name: getattr(self, name)[start:stop] for name in self.__dataclass_fields__}
        )

    @property
    def tokens(self) -> int:
        return int(self.mask.sum().item())


def pack(
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    behaviour_logp: list[list[float]] | None = None,
    advantages: list[float] | None = None,
) -> SequenceBatch:
    """Concatenate each prompt with its completion; only completion tokens are trained."""
    if len(prompts) != len(completions):
        raise ValueError("one prompt per completion is needed")
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    size = len(prompts)
    input_ids = torch.full((size, width), pad_id, dtype=torch.long)
    attention = torch.zeros((size, width), dtype=torch.long)
    targets = torch.full((size, width), pad_id, dtype=torch.long)
    mask = torch.zeros((size, width))
    old_logp = torch.zeros((size, width))
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        sequence = prompt + completion
        n = len(sequence) - 1
        input_ids[i, :n] = torch.tensor(sequence[:-1])
        attention[i, :n] = 1
        targets[i, :n] = torch.tensor(sequence[1:])
        first = len(prompt) - 1
        mask[i, first : first + len(completion)] = 1.0
        if behaviour_logp is not None:
            old_logp[i, first : first + len(completion)] = torch.tensor(behaviour_logp[i])
    adv = torch.tensor(advantages if advantages is not None else [0.0] * size).reshape(-1, 1)
    return SequenceBatch(input_ids, attention, targets, mask, old_logp, adv)
