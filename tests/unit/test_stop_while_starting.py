"""SIGTERM while a rank starts: acted on by a thread (the main thread may be blocked in
a C call; tests/e2e/test_rank_start_verdicts.py shows it on a real rank), and handed over
for good once GracefulStop is installed: after the run, restoring its previous handler,
GracefulStop brings back the one from before the start, never the start's "nothing
had run" (which would then overwrite the run's own verdict)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from rlft.trainer import stop_while_starting
from rlft.trainer.checkpoint.emergency import GracefulStop
from rlft.trainer.stop_while_starting import StopWhileStarting


@pytest.fixture
def sigterm_restored() -> Iterator[None]:
    handler, fd = signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    yield
    signal.signal(signal.SIGTERM, handler)
    signal.set_wakeup_fd(fd)
    stop_while_starting._current = None


def test_a_sigterm_while_starting_is_acted_on_by_a_thread(sigterm_restored):
    called: list[str] = []
    done = threading.Event()

    def on_sigterm() -> None:
        called.append(threading.current_thread().name)
        done.set()

    starting = StopWhileStarting(on_sigterm).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert done.wait(10)
        assert called == ["stop-while-starting"]
    finally:
        starting.uninstall()


def test_graceful_stop_takes_sigterm_over_for_good(sigterm_restored):
    before = signal.getsignal(signal.SIGTERM)
    fd_before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd_before)
    called: list[bool] = []
    StopWhileStarting(lambda: called.append(True)).install()
    stop = GracefulStop(30.0).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread
        assert stop.requested
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(fd_before) == fd_before
    assert called == []


def test_a_sigterm_the_thread_has_not_reached_goes_to_graceful_stop(sigterm_restored):
    """The main thread's handler notes the signal at once; the thread acts only once it
    gets the GIL. GracefulStop installed in between used to leave it to nobody: the rank
    trained on and was SIGKILLed at the end of its grace, without a checkpoint."""
    called: list[bool] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the main thread keeps the GIL until it waits
    try:
        starting = StopWhileStarting(lambda: called.append(True)).install()
        os.kill(os.getpid(), signal.SIGTERM)
        stop = GracefulStop(30.0).install()
    finally:
        sys.setswitchinterval(switch)
    try:
        assert starting.received
        assert stop.requested
    finally:
        stop.uninstall()
    time.sleep(1.0)  # the thread, had it been left the signal, would have acted by now
    assert called == []


def test_a_sigterm_after_the_run_leaves_the_rank_time_to_write_its_verdict(
    sigterm_restored, monkeypatch
):
    """After the run GracefulStop put SIGTERM's default action back: torchrun stopping
    the survivors of a rank that died killed them as they wrote their verdicts (exit -15,
    none written). A late SIGTERM now leaves the rank LATE_GRACE_SECONDS to end, then
    calls `on_late_sigterm` (the rank's: a verdict unless it wrote one, and exit 1)."""
    # Long enough that a loaded machine's pause before the check below is not taken for
    # the grace running out.
    monkeypatch.setattr(stop_while_starting, "LATE_GRACE_SECONDS", 3.0)
    late = threading.Event()
    StopWhileStarting(lambda: None, on_late_sigterm=late.set).install()
    stop = GracefulStop(30.0).install()
    stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)  # before: SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)
    assert not late.is_set()  # the rank goes on writing its verdict
    assert late.wait(30)
