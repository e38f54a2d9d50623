"""Process groups, FSDP2 sharding and launching: kept apart from model and algorithm
code, which only sees a `Dist` handle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlft.trainer.distributed.runtime import Dist

__all__ = ["Dist"]


def __getattr__(name: str) -> Any:
    # On first use: `rlft train --nproc` launches torchrun from here (launch.py) and
    # needs no torch of its own (1.5 s before the workers even start).
    if name == "Dist":
        from rlft.trainer.distributed.runtime import Dist

        return Dist
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
