"""The handle every distributed step uses: rank, world size, and the few collectives the
trainer needs. A single process is simply world size 1 (no process group at all)."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from rlft.trainer.redaction import finish_output
from rlft.trainer.telemetry import liveness


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place, and returned; a no-op in a single process."""
        if self.active:
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op])
        return tensor

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """`value` of rank `src` on every rank (any picklable object)."""
        if not self.active:
            return value
        box = [value if self.rank == src else None]
        if self.rank == src:
            dist.broadcast_object_list(box, src=src)
        else:  # waiting for what rank `src` makes (rollouts, an evaluation): its to judge
            with liveness.waiting(f"waiting for rank {src}"):
                dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            _barrier(self.rank)


def _barrier(rank: int) -> None:
    """Every rank's arrival; ranks other than 0 wait for rank 0's own work here (its
    output folder, its final files), which rank 0's liveness judges."""
    if rank == 0:
        dist.barrier()
        return
    with liveness.waiting("waiting for rank 0"):
        dist.barrier()


def init_from_env(timeout_s: float = 600.0) -> Dist:
    """Join the process group torchrun described in the environment (gloo on CPU, NCCL on
    GPU), or return a single-process handle when not launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return Dist(rank=rank, world=world, device=device)


_left_peers = False
"""This rank ended on an error of its own (`leave_peers`)."""


def leave_peers() -> None:
    """Mark this rank as ending on an error of its own: `shutdown` then ends it without
    the goodbye barrier. Its peers may be blocked in a collective it will never join (a
    step that failed on one rank only, while the others wait for its batch or gradient),
    and would never reach that barrier: both waited for the other until the group's
    timeout (10 minutes at least). Its exit breaks their collective at once instead."""
    global _left_peers
    _left_peers = True


def shutdown() -> None:
    """Leave the process group once every rank is done with it (a rank destroying it
    while another still talks aborts the other in gloo's threads); at once, without
    waiting for the others, after `leave_peers` (`exit_worker` then ends the process
    with the group in place, so nothing is destroyed under a peer)."""
    if dist.is_initialized() and not _left_peers:
        _barrier(dist.get_rank())
        dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """End a torchrun rank without interpreter finalization. After `shutdown` the process
    groups are gone from torch's registry but still referenced by FSDP's device meshes;
    finalization then destroys them with gloo threads still attached, and the rank aborts
    ("terminate called without an active exception", SIGABRT) in a few runs out of a
    hundred. Everything a rank writes is closed and flushed before it ends."""
    logging.shutdown()
    finish_output()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
