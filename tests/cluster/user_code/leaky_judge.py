"""A user's reward that leaks its judge's keys: the one from a variable where `rlft`'s own
streams cannot scrub it (a subprocess, a judge's command-line client, prints it, and a
write goes straight to the file descriptor, as a C library's does), and one read from a
Secret mounted as files, printed by a subprocess and by `print`. On the test cluster the
pod's log shows none of them: the container's command runs under `rlft scrubbed`
(trainer/cli/scrubbed.py), and the operator names the Secret's mount to it."""

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
        subprocess.run(["sh", "-c", 'echo "judge file: key $(cat $JUDGE_KEY_FILE)" >&2'])
        with open(os.environ["JUDGE_KEY_FILE"]) as file:
            print(f"judge print: key {file.read()}", flush=True)
    return 0.0
