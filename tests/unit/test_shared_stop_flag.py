"""The group's shared stop flag on a real TCPStore: a signal that comes while the main
thread is blocked in C++ (here the store's own wait, as a rank waits in a collective)
still sets the key, from the watcher thread; a group sees only its own key."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from rlft.trainer.distributed.peer_stop import KEY, PeerStop


def test_a_signal_to_a_blocked_main_thread_sets_its_groups_key_and_no_other():
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    handled: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(signum))
    peer = PeerStop(store, 1, f"{KEY}/this-group")
    rank_0 = PeerStop(store, 0, f"{KEY}/this-group")
    another_group = PeerStop(store, 0, f"{KEY}/another-group")
    peer.watch((signal.SIGUSR1,))
    try:
        assert not rank_0.requested()
        # The signal comes while the main thread waits in C++, where its Python handler
        # cannot run: only the watcher thread can set the key this wait is for. (On a
        # client of its own: a client serves one call at a time, and a rank's collective
        # does not go through the store.)
        waiting = TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        waiting.wait([f"{KEY}/this-group"], timedelta(seconds=20))
        assert rank_0.requested()
        assert not another_group.requested()
        assert handled == [signal.SIGUSR1]  # the handler still ran, after the wait
    finally:
        peer.close()
        signal.signal(signal.SIGUSR1, previous)
    assert signal.set_wakeup_fd(-1) == -1  # close gave the wakeup fd back


def test_every_rank_reads_when_the_first_signal_came_and_a_later_one_keeps_it():
    """What a rank stopping for another's signal gives up within: that signal's grace,
    counted from when it came (the first one's: a later signal does not move it on)."""
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30))
    came = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: came.set())
    rank_0 = PeerStop(store, 0, f"{KEY}/group")
    rank_1 = PeerStop(store, 1, f"{KEY}/group")
    rank_0.watch((signal.SIGUSR1,))
    try:
        assert rank_1.seconds_since(30) is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert came.wait(10)
        deadline = time.monotonic() + 10
        while rank_1.seconds_since(30) is None:
            assert time.monotonic() < deadline, "the watcher never set the key"
            time.sleep(0.01)
        time.sleep(0.5)
        first = store.get(f"{KEY}/group")
        os.kill(os.getpid(), signal.SIGUSR1)  # a second signal, half a second on
        time.sleep(0.3)
        assert store.get(f"{KEY}/group") == first and first.startswith(b"0 ")
        assert 0.5 <= rank_1.seconds_since(30) < 30
        # A time further back than the grace is a clock ahead of the signalled rank's.
        assert rank_1.seconds_since(0.1) is None
    finally:
        rank_0.close()
        signal.signal(signal.SIGUSR1, previous)
