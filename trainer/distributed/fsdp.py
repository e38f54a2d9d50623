"""Sharding a transformers model with FSDP2 (`fully_shard`), one unit per decoder layer.

Gradients are *summed* across ranks, not averaged: the losses are already divided by
whole-batch counts (see algorithms/aggregation.py), and FSDP's default division by the
world size would make the update depend on it.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rlft.trainer.config import Parallelism
from rlft.trainer.distributed.runtime import Dist


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers causal LM or token classifier."""
    backbone = getattr(model, "model", None) or getattr(model, "base_model", model)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return list(layers)


_MESHES: dict[tuple[str, int], object] = {}


def _mesh(dist: Dist):
    """One device mesh per process: each `init_device_mesh` makes new process groups."""
    key = (dist.device.type, dist.world)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(dist.device.type, (dist.world,))
    return _MESHES[key]


def shard_model(model: torch.nn.Module, parallelism: Parallelism, dist: Dist) -> torch.nn.Module:
    """Apply activation checkpointing and FSDP2 in place; returns the same module."""
    if parallelism.activation_checkpointing:
        # transformers ≥ 5.2x renamed gradient_checkpointing_enable (now deprecated)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    if not dist.active:
        return model
    mesh = _mesh(dist)
    policy = MixedPrecisionPolicy()
    if parallelism.mixed_precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    options = {
        "mesh": mesh,
        "mp_policy": policy,
        "reshard_after_forward": parallelism.reshard_after_forward,
    }
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and with a factor of 1 there
            # is nothing to pre- or post-scale.
            module.set_force_sum_reduction_for_comms(True)
    return model


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or gradient; collective when
    sharded, so every rank must call it in the same order."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value
