"""Starting N local worker processes with torchrun (`rlft train --nproc`, `rlft verify`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator


def torchrun_command(nproc: int, module: str, args: list[str], log_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        # Without one, torchrun leaves a torchelastic_* folder in /tmp per launch.
        f"--log-dir={log_dir}",
        "-m",
        module,
        *args,
    ]


def _log_dir() -> tempfile.TemporaryDirectory:
    """torchrun's logs for one launch; a cleanup error never hides the launch's own."""
    return tempfile.TemporaryDirectory(prefix="rlft-torchrun-", ignore_cleanup_errors=True)


def worker_env(nproc: int) -> dict[str, str]:
    """The parent's environment, with threads split between the workers so that N
    processes do not oversubscribe the cores (tiny models run fastest single-threaded)."""
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    # The agent's shared TCPStore keeps dead workers' addresses (see docs/build.md).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return env


def run_workers(
    nproc: int,
    module: str,
    args: list[str],
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run the module on `nproc` local ranks (with `env` added to their environment);
    returns torchrun's exit code."""
    with _log_dir() as logs, _deaf_to_ctrl_c():
        command = torchrun_command(nproc, module, args, logs)
        environment = worker_env(nproc) | (env or {})
        return subprocess.run(command, env=environment, timeout=timeout_s).returncode


@contextlib.contextmanager
def _deaf_to_ctrl_c() -> Iterator[None]:
    """Ctrl-C reaches torchrun too (one foreground process group), which passes it to its
    workers (each in a session of its own) for their emergency checkpoint: this process
    waits for it to finish. Left to raise here, `subprocess.run` would kill torchrun a
    quarter of a second later, mid-checkpoint, with its workers orphaned. A handler, not
    SIG_IGN, which torchrun would inherit through exec."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class WorkersFailed(RuntimeError):
    """The workers exited non-zero; the message holds the first error lines they printed."""


def run_workers_captured(
    nproc: int, module: str, args: list[str], timeout_s: float | None = None, attempts: int = 2
) -> str:
    """Run the module on `nproc` local ranks, capturing their output; a launch that fails
    before the workers start (the free rendezvous port taken by another process in the
    meantime) is retried. Returns the output; raises `WorkersFailed` otherwise."""
    output = ""
    for _ in range(attempts):
        with _log_dir() as logs:
            done = subprocess.run(
                torchrun_command(nproc, module, args, logs),
                env=worker_env(nproc),
                timeout=timeout_s,
                capture_output=True,
                text=True,
            )
        output = done.stdout + done.stderr
        if done.returncode == 0:
            return output
        if not any(sign in output for sign in _LAUNCH_FAILURES):
            break
    raise WorkersFailed(_first_worker_error(output))


def _first_worker_error(output: str) -> str:
    """The end of the first rank's traceback (torchrun prefixes its lines `[rankN]:`),
    else the tail of the output."""
    lines = output.splitlines()
    native = [line for line in lines if "terminate called" in line or "what():" in line]
    if native:  # a C++ abort (SIGABRT) prints no Python traceback
        return "\n".join(native[:4])
    for rank_tag in sorted({line.split("]:")[0] for line in lines if line.startswith("[rank")}):
        own = [line for line in lines if line.startswith(rank_tag + "]:")]
        if own:
            return "\n".join(own[-6:])
    return "\n".join(lines[-20:])


_LAUNCH_FAILURES = ("Address already in use", "EADDRINUSE", "RendezvousConnectionError")
