"""Process groups, FSDP2 sharding and launching: kept apart from model and algorithm
code, which only sees a `Dist` handle."""

from rlft.trainer.distributed.runtime import Dist

__all__ = ["Dist"]
