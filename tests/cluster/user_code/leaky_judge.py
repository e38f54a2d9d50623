"""A user's reward that leaks its judge's key where `rlft`'s own streams cannot scrub it:
a subprocess (a judge's command-line client) prints it, and a write straight to the file
descriptor (what a C library does). On the test cluster the pod's log shows neither: the
container's command runs under `rlft scrubbed` (trainer/cli/scrubbed.py)."""

from __future__ import annotations

import os
import subprocess

_told = False


def judge(completion: str, answer: str) -> float:
    global _told
    if not _told:  # once a process: the point is where the text goes, not how often
        _told = True
        subprocess.run(["sh", "-c", 'echo "judge client: key $JUDGE_API_KEY" >&2'], check=False)
        os.write(1, f"judge fd: key {os.environ['JUDGE_API_KEY']}\n".encode())
    return 0.0
