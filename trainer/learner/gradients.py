"""One optimizer step's gradient, the same code for every algorithm, micro-batch size and
world size: the batch's normalisers are summed over all ranks *before* any backward, so
the accumulated (and FSDP-summed) gradient is that of the whole batch.

`Faults` plants the two classic bugs on purpose; it exists so that `rlft verify` can show
that it catches them, and is never set by a training run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rlft.trainer.algorithms.aggregation import Normalisers
from rlft.trainer.algorithms.batch import SequenceBatch, empty_like, micro_batches
from rlft.trainer.algorithms.objectives import Models, Prepared
from rlft.trainer.distributed import Dist
from rlft.trainer.distributed.fsdp import full_tensor
from rlft.trainer.telemetry import liveness


@dataclass(frozen=True)
class Faults:
    per_micro_batch_normaliser: bool = False
    """Divide each micro-batch by its own counts (the bug TRL and others shipped)."""
    drop_last_micro_batch: bool = False
    """Skip the last micro-batch's backward (the optimizer-offload bug)."""


NO_FAULTS = Faults()


@dataclass
class StepPlan:
    micros: list[SequenceBatch]
    prepared: list[Prepared]
    norms: Normalisers


def _local_norms(batch: SequenceBatch, unit: int) -> Normalisers:
    pairs = int((batch.mask.sum(-1)[0::2] > 0).sum().item()) if unit == 2 else 0
    return Normalisers.local(batch.mask, batch.attention_mask, pairs)


def plan_step(
    objective,
    models: Models,
    shard: SequenceBatch,
    template: SequenceBatch,
    micro_batch_size: int,
    dist: Dist,
) -> StepPlan:
    """Split this rank's shard, pad the micro-batch count to the ranks' maximum (FSDP runs
    collectives in every forward), sum the normalisers over ranks, and run the
    objective's no-grad preparation."""
    unit = objective.unit
    micros = micro_batches(shard, micro_batch_size, unit) if len(shard) else []
    most = int(dist.all_reduce(torch.tensor([len(micros)]), "max").item())
    micros += [empty_like(template, unit) for _ in range(most - len(micros))]
    local = _local_norms(shard, unit) if len(shard) else Normalisers(0.0, 0.0)
    norms = Normalisers.from_tensor(dist.all_reduce(local.as_tensor()))
    with torch.no_grad():
        prepared = [objective.prepare(models, micro) for micro in micros]
    return StepPlan(micros, prepared, norms)


def backward(objective, models: Models, plan: StepPlan, dist: Dist, faults: Faults = NO_FAULTS):
    """Accumulate the gradient of the whole batch's loss; returns the step's summed
    statistics (reduced over ranks: `*_max` by max, `*_min` by min, the rest summed)."""
    pairs = list(zip(plan.micros, plan.prepared, strict=True))
    if faults.drop_last_micro_batch:
        pairs = pairs[:-1]
    sums: dict[str, float] = {}
    for i, (micro, prepared) in enumerate(pairs):
        liveness.beat(f"backward pass: micro-batch {i + 1} of {len(pairs)}")
        norms = plan.norms
        if faults.per_micro_batch_normaliser:
            norms = _local_norms(micro, objective.unit)
        loss, stats = objective.loss(models, micro, prepared, norms)
        loss.backward()
        _merge(sums, stats)
    return reduce_stats(sums, dist)


def _merge(total: dict[str, float], new: dict[str, float]) -> None:
    for key, value in new.items():
        if key.endswith("_max"):
            total[key] = max(total.get(key, float("-inf")), value)
        elif key.endswith("_min"):
            total[key] = min(total.get(key, float("inf")), value)
        else:
            total[key] = total.get(key, 0.0) + value


def reduce_stats(sums: dict[str, float], dist: Dist) -> dict[str, float]:
    if not dist.active:
        return sums
    keys = sorted(dist.broadcast(sorted(sums)))
    out = {}
    for op, chosen in (
        ("max", [k for k in keys if k.endswith("_max")]),
        ("min", [k for k in keys if k.endswith("_min")]),
        ("sum", [k for k in keys if not k.endswith(("_max", "_min"))]),
    ):
        default = {"max": float("-inf"), "min": float("inf"), "sum": 0.0}[op]
        values = torch.tensor([sums.get(k, default) for k in chosen], dtype=torch.float64)
        out |= dict(zip(chosen, dist.all_reduce(values, op).tolist(), strict=True))
    return out


def clip_and_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (across shards and ranks); returns it before
    clipping."""
    grads = [p for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
    return float(full_tensor(norm).item())


def clip_to_norm(parameters: list[torch.nn.Parameter], max_norm: float, norm: float) -> None:
    """Clip gradients whose global norm is already known (e.g. from `group_grad_norms`)."""
    grads = [p for p in parameters if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, torch.tensor(norm))


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (zeros where none), on every rank: collective."""
    out = {}
    for name, parameter in model.named_parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        out[name] = full_tensor(grad).detach().clone()
    return out


def group_grad_norms(model: torch.nn.Module, dist: Dist) -> dict[str, float]:
    """L2 gradient norm per parameter group (embeddings, each layer, final norm, head),
    across shards and ranks; call before clipping."""
    squares: dict[str, float] = {}
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        grad = parameter.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        group = parameter_group(name)
        squares[group] = squares.get(group, 0.0) + float(local.double().square().sum())
    names = sorted(squares)
    totals = torch.tensor([squares[n] for n in names], dtype=torch.float64)
    if dist.active:  # every rank holds a shard of every parameter (FSDP2)
        totals = dist.all_reduce(totals)
    return {n: float(v) ** 0.5 for n, v in zip(names, totals.tolist(), strict=True)}


_LAYER = re.compile(r"layers\.(\d+)\.")


def parameter_group(name: str) -> str:
    match = _LAYER.search(name)
    if match:
        return f"layer_{int(match.group(1)):03d}"
    for key, label in (("embed", "embeddings"), ("lm_head", "lm_head"), ("norm", "final_norm")):
        if key in name:
            return label
    return "other"
