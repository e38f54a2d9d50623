"""The tensor state of a checkpoint: model and optimizer through torch.distributed's
state-dict API, so FSDP2-sharded and plain modules look the same, and a checkpoint saved
at one world size loads at another (DCP reshards on load)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": …, "optim": …}: sharded (DTensor) under FSDP2, plain tensors otherwise.

    For an optimizer that has not stepped yet, torch initialises its state with a zero
    step at learning rate 0 (parameters unchanged), so the layout is complete.
    """
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_OPTIONS)}
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": model_state, "optim": optim_state}


def apply_tensor_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Put a loaded `tensor_state` back into the model and optimizer."""
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=_OPTIONS)
        return
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_OPTIONS,
    )
