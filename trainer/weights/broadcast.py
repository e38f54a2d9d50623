"""`broadcast` publication: trainer rank 0 sends the weights to every engine over a
torch.distributed group of its own (gloo here; NCCL on GPUs).

The group is separate from the trainer's FSDP group: rank 0 of it is trainer rank 0,
ranks 1..N are the rollout instances, which join when they receive
`POST /weights {version, broadcast: {address, rank, world_size}}`. One publication is
self-describing, so engines need no shape table in advance:

1. a 1-element int64 tensor: length of the JSON header
2. the header as uint8: version, [name, dtype, shape] per tensor
3. one flat buffer per dtype, tensors concatenated in header order

A change of membership (an instance died, a new one came up, one restarted at its
address) makes a new group on a new port; an instance that missed versions catches up
from the `store` location instead.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass

import torch
import torch.distributed as c10d

DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    world_size: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, address: str, world_size: int) -> GroupAddress:
        host, _, port = address.rpartition(":")
        return cls(host, int(port), world_size)


class BroadcastGroup:
    """One member of a weight-broadcast group (rank 0 = the trainer, the source)."""

    def __init__(
        self,
        address: GroupAddress,
        rank: int,
        timeout_s: float = 60.0,
        bind_host: str = "127.0.0.1",
    ):
        self.address, self.rank = address, rank
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = c10d.TCPStore(
            address.host, address.port, address.world_size, rank == 0, timeout=timeout
        )
        options = c10d.ProcessGroupGloo._Options()
        options._devices = [c10d.ProcessGroupGloo.create_device(hostname=bind_host)]
        options._timeout = timeout
        self.group = c10d.ProcessGroupGloo(
            c10d.PrefixStore("rlft-weights/", self.store), rank, address.world_size, options
        )

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = c10d.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        return tensor

    def send(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Rank 0: broadcast `state` (names → tensors) as policy `version`."""
        assert self.rank == 0
        entries = [[name, str(t.dtype), list(t.shape)] for name, t in state.items()]
        header = json.dumps({"version": version, "tensors": entries}).encode()
        self._broadcast(torch.tensor([len(header)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        for dtype in _dtypes_in_order(entries):
            parts = [state[n].detach().reshape(-1) for n, d, _ in entries if d == dtype]
            self._broadcast(torch.cat(parts).contiguous())

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Ranks ≥ 1: the version and the tensors rank 0 sent."""
        length = self._broadcast(torch.zeros(1, dtype=torch.int64))
        raw = self._broadcast(torch.zeros(int(length.item()), dtype=torch.uint8))
        header = json.loads(bytes(raw.tolist()).decode())
        entries = header["tensors"]
        out: dict[str, torch.Tensor] = {}
        for dtype in _dtypes_in_order(entries):
            chosen = [(n, s) for n, d, s in entries if d == dtype]
            total = sum(_numel(s) for _, s in chosen)
            flat = self._broadcast(torch.empty(total, dtype=DTYPES[dtype]))
            offset = 0
            for name, shape in chosen:
                out[name] = flat[offset : offset + _numel(shape)].reshape(shape)
                offset += _numel(shape)
        return int(header["version"]), out


def _dtypes_in_order(entries: list) -> list[str]:
    order: list[str] = []
    for _, dtype, _ in entries:
        if dtype not in DTYPES:
            raise ValueError(f"weight broadcast: unsupported dtype {dtype}")
        if dtype not in order:
            order.append(dtype)
    return order


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
