"""glibc's allocator, set once when a training process starts.

glibc raises its mmap threshold (from 128 KiB up to 32 MiB) each time a block above it is
freed, so later blocks of that size come from the heap instead of fresh mappings. A
checkpointing trainer frees large blocks at every save, and its heap then fragments
around them: in `bench/soak.py` its resident memory grew about 80 KiB a checkpoint (4.1
KiB a step at a checkpoint every 20 steps), for good. A fixed threshold of 4 MiB kept it
flat (0.08 KiB a step) at no cost to the CPU step (the `make run` job trained in 46 s,
against 44–45 s); glibc's own 128 KiB kept it flat too but nearly doubled that step
(82 s): every large tensor was then mapped and unmapped each time.
"""

from __future__ import annotations

import ctypes
import os

MMAP_THRESHOLD_BYTES = 4 << 20
ENV = "MALLOC_MMAP_THRESHOLD_"
"""glibc reads it at a process's start; a user's own value is left as it is."""
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_mmap_threshold(environ: dict[str, str] | None = None) -> bool:
    """Fix glibc's mmap threshold (which ends its dynamic raise); False where the
    environment sets one, or there is no glibc (musl, macOS) or it refused."""
    if ENV in (os.environ if environ is None else environ):
        return False
    try:
        return ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    except (OSError, AttributeError):
        return False
