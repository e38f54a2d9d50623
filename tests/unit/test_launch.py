"""`rlft train --nproc`'s torchrun command line, its signal relay, and a launch run in
process."""

from __future__ import annotations

import signal
import subprocess

import pytest

from rlft.trainer.distributed import launch
from rlft.trainer.distributed.launch import (
    _child_subreaper,
    _SignalRelay,
    run_workers,
    torchrun_command,
)


def test_torchrun_waits_the_jobs_grace_for_its_workers_before_killing_them():
    """Its own default is 30 s: an emergency checkpoint with a longer grace was cut off."""
    command = torchrun_command(2, "rlft.trainer.cli.main", ["train"], "/tmp/logs", 45.2)
    assert "--shutdown-timeout=46" in command
    assert command.index("--shutdown-timeout=46") < command.index("-m", 3)  # torchrun's own


def test_without_a_grace_torchrun_keeps_its_default():
    command = torchrun_command(2, "rlft.trainer.cli.main", ["train"], "/tmp/logs")
    assert not any(part.startswith("--shutdown-timeout") for part in command)


def test_a_hangup_the_process_ignores_stays_ignored():
    """`nohup rlft train --nproc 2`: the hangup nohup ignores must not stop the run."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _SignalRelay() as relay:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == relay._handle  # relayed
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_launch_in_process_leaves_the_callers_own_children_and_reaper_alone():
    """`rlft train --nproc` called in process (as tests call `main`): the launch kills
    only the orphans it leaves. It used to kill every child of the caller once torchrun
    exited (a test worker's S3 server among them), and left the caller the reaper of
    every later orphan."""
    server = subprocess.Popen(["sleep", "60"])  # the caller's own child
    try:
        before = _child_subreaper(None)
        code = run_workers(1, "this", [], timeout_s=120)  # `python -m this`: prints, exits 0
        assert code == 0
        assert server.poll() is None, "the launch killed the caller's own child"
        assert _child_subreaper(None) == before
    finally:
        server.kill()
        server.wait()


def test_a_signal_that_killed_torchrun_before_it_had_a_group_ends_the_launch_cleanly(
    monkeypatch,
):
    """A Ctrl-C reaches the terminal's whole group, torchrun's child too if it comes
    between its fork and its own setpgid: it dies there, with no group of its own to
    kill. `rlft train` ended in a ProcessLookupError traceback; it ends as any stop
    before the workers started does."""
    real_popen = subprocess.Popen

    def dies_before_its_group(command, **kwargs):
        child = real_popen(["true"])  # in this process's group, as before setpgid
        child.wait()  # gone: no group numbered by its pid
        child.returncode = None  # ...as the relay sees it (not waited for yet)
        signal.raise_signal(signal.SIGTERM)  # the signal came while it was being started
        return child

    monkeypatch.setattr(launch.subprocess, "Popen", dies_before_its_group)
    with pytest.raises(launch.StoppedBeforeStart) as stopped:
        run_workers(2, "this", [], timeout_s=30)
    assert stopped.value.signum == signal.SIGTERM
