"""Stopping a process a test started: a signal, a grace, then SIGKILL (by process id)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from rlft.trainer.distributed.launch import child_pids


def stop_process(process: subprocess.Popen, timeout: float = 10, sig: int = signal.SIGTERM) -> None:
    """Send `sig`, wait up to `timeout` seconds, then kill; always reaps the process."""
    if process.poll() is not None:
        return
    process.send_signal(sig)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (from /proc), children before grandchildren. torchrun
    starts its workers in sessions of their own, so killing the agent's process group
    leaves them running."""
    found, queue = [], [pid]
    while queue:
        children = child_pids(queue.pop(0))
        found += children
        queue += children
    return found


def read_proc(pid: int, name: str) -> bytes:
    """/proc/PID/NAME; empty for a process gone since it was listed."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def descendants_running(root: int, module: str) -> list[int]:
    """The descendants of `root` whose command line names `module`."""
    return [pid for pid in descendants(root) if module.encode() in read_proc(pid, "cmdline")]


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL `process` and all its descendants, by process id; reaps `process`."""
    for pid in [*descendants(process.pid), process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def private_tmp(folder: Path) -> Path:
    """A process's own temporary folder (its TMPDIR), as a pod has its own /tmp: what
    torchrun and the trainer leave there stays in the test's folder, not the machine's."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder
