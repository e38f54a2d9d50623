"""Starting N local worker processes with torchrun (`rlft train --nproc`, `rlft verify`)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def torchrun_command(
    nproc: int, module: str, args: list[str], log_dir: str, grace_s: float | None = None
) -> list[str]:
    """torchrun starting `module` on `nproc` local ranks. `grace_s`: how long the agent
    waits for its workers after passing them a signal before it kills them (its own
    default is 30 s): a job's emergency checkpoint gets its whole grace period."""
    shutdown = [] if grace_s is None else [f"--shutdown-timeout={math.ceil(grace_s)}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        # Without one, torchrun leaves a torchelastic_* folder in /tmp per launch.
        f"--log-dir={log_dir}",
        *shutdown,
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
    grace_s: float | None = None,
) -> int:
    """Run the module on `nproc` local ranks (with `env` added to their environment, and
    `grace_s` to stop on a signal); returns torchrun's exit code. Raises KeyboardInterrupt
    once torchrun has exited if Ctrl-C came twice (the workers were stopped at once,
    without their checkpoint), and StoppedBeforeStart if a signal came before torchrun
    had started them.

    While it runs, this process is the reaper of the launch's orphans; once torchrun has
    exited it kills what is left of them (children it did not have before)."""
    was_reaper = _child_subreaper(None)
    _child_subreaper(True)
    before = set(child_pids(os.getpid()))
    try:
        with _log_dir() as logs, _SignalRelay() as relay:
            command = torchrun_command(nproc, module, args, logs, grace_s)
            environment = worker_env(nproc) | (env or {})
            # A process group of its own: a terminal's Ctrl-C reaches this process alone,
            # which passes it on (_SignalRelay).
            relay.agent = subprocess.Popen(command, env=environment, process_group=0)
            if relay.early is not None:  # the signal came while it was being started
                # A Ctrl-C to the terminal's group can kill the child before it has a
                # group of its own (between fork and setpgid): nothing is left to stop.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(relay.agent.pid, signal.SIGKILL)
            try:
                code = relay.agent.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                relay.agent.kill()
                relay.agent.wait()
                raise
    finally:
        stop_orphans(keep=before)
        if not was_reaper:  # a test runner calling this keeps its own orphans' reaper
            _child_subreaper(False)
    if relay.early is not None:
        raise StoppedBeforeStart(relay.early)
    if relay.ctrl_c >= 2:
        raise KeyboardInterrupt
    return code


class StoppedBeforeStart(Exception):
    """A signal came before torchrun had started the workers: nothing had run, so there
    was nothing to checkpoint, and torchrun was stopped at once."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"{signal.Signals(signum).name} before the workers started")


PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _child_subreaper(on: bool | None) -> bool:
    """Set (True, False) or read (None) whether orphans of this process's descendants
    become its children rather than init's; returns whether they do (False where prctl
    is not there: not Linux). torchrun starts each worker in a session of its own: a
    torchrun killed outright (the OOM killer, a SIGKILL) or stopped while it starts them
    left workers that trained on, unseen, beside a rerun writing the same folder."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if on is not None:
            return libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0 and on
        flag = ctypes.c_int(0)
        return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and bool(
            flag.value
        )
    except (OSError, AttributeError):
        return False


def stop_orphans(keep: set[int] = frozenset()) -> list[int]:
    """SIGKILL the process groups of this process's children other than `keep`, and reap
    them: after torchrun has exited, those are orphans of the launch (workers it left,
    and what they started). Returns their process ids."""
    orphans = [pid for pid in child_pids(os.getpid()) if pid not in keep]
    _signal_groups(orphans, signal.SIGKILL)
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # one that left its group (setsid) too
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return orphans


KILL_AFTER_SECONDS = 5.0
"""After a second Ctrl-C, how long a worker has to stop before it is killed: a rank blocked
in a collective (its peer hung) runs no Python signal handler until the call returns."""


class _SignalRelay:
    """Passes Ctrl-C and SIGTERM from `rlft train --nproc` to torchrun's workers (each in a
    session of its own), not to torchrun: its agent would forward the first and then,
    with its workers already stopped, end in a traceback of its own, and it does not pass
    on a second Ctrl-C at all. So the first Ctrl-C or SIGTERM goes to the workers, which
    checkpoint the step in hand and exit 0, and torchrun with them. A second Ctrl-C goes
    to them too and stops them at once; KILL_AFTER_SECONDS later what is left of them is
    killed. Before torchrun has started workers, torchrun is stopped at once.
    A hangup (the terminal closed) goes on as SIGTERM: torchrun, out of the terminal's
    foreground group, would not get it, and would run on with its workers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.agent: subprocess.Popen | None = None
        self.ctrl_c = 0
        self.early: int | None = None
        """The signal that came before torchrun had started the workers, if one did."""
        self._previous: dict[int, object] = {}
        self._kill: threading.Timer | None = None

    def __enter__(self) -> _SignalRelay:
        if threading.current_thread() is threading.main_thread():
            # A hangup this process ignores stays ignored (`nohup`). An ignored SIGINT is
            # not: the ranks override it too (GracefulStop), and a test runner's worker
            # (pytest-xdist) hands it down ignored.
            self._previous = {
                s: signal.signal(s, self._handle)
                for s in self.SIGNALS
                if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN
            }
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self._kill is not None:
            self._kill.cancel()

    def _handle(self, signum: int, frame: object) -> None:
        workers = [] if self.agent is None else child_pids(self.agent.pid)
        if not workers or self.early is not None:
            # Nothing has run to checkpoint, and torchrun's own handling of the signal
            # ends in a traceback: stop it at once (run_workers stops one not started
            # yet, and the orphans of workers it was just starting).
            self.early = signum if self.early is None else self.early
            if self.agent is not None and self.agent.returncode is None:  # pid still its own
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.agent.pid, signal.SIGKILL)
            return
        if signum == signal.SIGINT:
            self.ctrl_c += 1
        elif signum == signal.SIGHUP:
            signum = signal.SIGTERM  # what the workers checkpoint on
        _signal_groups(workers, signum)
        if self.ctrl_c == 2 and self._kill is None:
            self._kill = threading.Timer(
                KILL_AFTER_SECONDS, _signal_groups, (workers, signal.SIGKILL)
            )
            self._kill.daemon = True
            self._kill.start()


def _signal_groups(leaders: list[int], signum: int) -> None:
    """Signal the process groups torchrun's workers lead (a group gone is skipped)."""
    for pid in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum)


def child_pids(pid: int) -> list[int]:
    """The live children of a process (Linux's /proc/PID/task/*/children); none once it
    has exited."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(child) for child in (task / "children").read_text().split()]
    return children


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
