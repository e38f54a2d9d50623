"""A rank stopped by a peer's SIGTERM waits a while for its own agent's (an elastic gang
growing: the agents stop their workers one after another), and no longer than that when
none comes (a peer preempted alone)."""

from __future__ import annotations

import os
import signal
import threading
import time

from rlft.trainer.cli.training import _await_own_agent


def test_the_wait_ends_when_the_agents_sigterm_arrives_and_restores_the_handler():
    def handler(signum, frame):
        raise AssertionError("the previous handler ran during the wait")

    previous = signal.signal(signal.SIGTERM, handler)
    try:

        def sigterm_once_waiting() -> None:  # not before the wait's own handler is set
            deadline = time.monotonic() + 10
            while signal.getsignal(signal.SIGTERM) is handler and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=sigterm_once_waiting, daemon=True).start()
        started = time.monotonic()
        _await_own_agent(30.0)
        assert time.monotonic() - started < 10.0
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_without_a_sigterm_the_wait_ends_at_its_bound():
    started = time.monotonic()
    _await_own_agent(0.3)
    assert 0.3 <= time.monotonic() - started < 5.0
