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


Modules = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]
"""More trained or frozen models of a run by name (PPO's critic, a KL reference), each
with its optimizer or None; stored next to the policy as `<name>` and `<name>.optim`."""


def _one(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_OPTIONS)}
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    if fresh:
        _unstep(optimizer, optim_state)
    return {"model": model_state, "optim": optim_state}


def _unstep(optimizer: torch.optim.Optimizer, optim_state: dict[str, Any]) -> None:
    """Undo the step count of the step torch takes to lay out a fresh optimizer's state
    (at learning rate 0, on zero gradients: moments stay zero). Left at 1, AdamW's bias
    correction of every later update would differ from a run that saved nothing before
    its first applied update (a skipped step, a group-less dynamic sampling round): the
    trajectory would depend on when checkpoints were taken. At 0 it steps as a fresh one."""
    for entries in (optimizer.state.values(), optim_state.get("state", {}).values()):
        for entry in entries:
            step = entry.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                entry["step"] = 0


def tensor_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    modules: Modules | None = None,
) -> dict[str, Any]:
    """{"model": …, "optim": …, plus `<name>` / `<name>.optim` per extra module}: sharded
    (DTensor) under FSDP2, plain tensors otherwise.

    For an optimizer that has not stepped yet, torch initialises its state with a step
    at learning rate 0 on zero gradients (parameters unchanged), so the layout is
    complete; its step count is set back to 0 (`_unstep`).
    """
    state = _one(model, optimizer)
    for name, (module, module_optimizer) in (modules or {}).items():
        part = _one(module, module_optimizer)
        state[name] = part["model"]
        if "optim" in part:
            state[f"{name}.optim"] = part["optim"]
    return state


def apply_tensor_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    modules: Modules | None = None,
) -> None:
    """Put a loaded `tensor_state` back into the model, optimizer and extra modules."""
    for name, (module, module_optimizer) in (modules or {}).items():
        part = {"model": state[name]}
        if module_optimizer is not None:
            part["optim"] = state[f"{name}.optim"]
        _apply(module, module_optimizer, part)
    _apply(model, optimizer, state)


def _apply(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
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
