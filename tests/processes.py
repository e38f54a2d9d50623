"""Stopping a process a test started: a signal, a grace, then SIGKILL (by process id)."""

from __future__ import annotations

import signal
import subprocess


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
