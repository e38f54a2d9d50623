"""The training process's fixed glibc mmap threshold (trainer/allocator.py): a block
above 4 MiB is mapped even after a larger one was freed, where glibc's dynamic threshold
would have served it from the heap (which then fragments around it)."""

from __future__ import annotations

import os
import subprocess
import sys

from rlft.trainer.allocator import ENV, fix_mmap_threshold

PROBE = """
import ctypes, sys
from rlft.trainer.allocator import fix_mmap_threshold
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
fixed = sys.argv[1] == "fix" and fix_mmap_threshold()
libc.free(libc.malloc(16 << 20))  # glibc's dynamic threshold rises to 16 MiB here
before = libc.mallinfo2().hblks
block = libc.malloc(6 << 20)
print(fixed, libc.mallinfo2().hblks - before)
libc.free(block)
"""


def _mapped_after_a_larger_free(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    fixed, mapped = out.stdout.split()
    return fixed, int(mapped)


def test_a_fixed_threshold_keeps_large_blocks_out_of_the_heap() -> None:
    assert _mapped_after_a_larger_free("fix") == ("True", 1)
    assert _mapped_after_a_larger_free("leave") == ("False", 0)  # glibc's own: from the heap


def test_a_threshold_the_environment_sets_is_left_to_glibc() -> None:
    assert fix_mmap_threshold({ENV: "131072"}) is False
