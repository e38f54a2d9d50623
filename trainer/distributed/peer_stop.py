"""A stop signal that reaches a rank other than 0 while rank 0 waits on its own.

Rank 0 alone waits for rollouts (or for the rollout pods to start); the other ranks wait
for it inside a collective, in C++, where their Python SIGTERM handler cannot run until
rank 0 broadcasts. A preempted pod without rank 0 learned of its own SIGTERM only after
rank 0's wait, which can outlast the grace period (rollout pods restarting, a slow
generation): its watchdog then ended it without an emergency checkpoint, and the gang
lost the steps since the last periodic one.

CPython's C-level handler writes the signal's number to the wakeup fd at once, whatever
the main thread is doing. A thread reading it here sets a key in the process group's
store; rank 0's waits poll that key (`Checkpointing.stopping`), stop waiting, broadcast
the stop, and every rank checkpoints the step it finished last.

The other way round too: every rank watches, and the key holds when the first signal
came. A rank waiting for its own save's retries (a rollback's or the final wait, where
no step's collective shares the stop) learns of a signal that reached only rank 0, and
gives up within that rank's grace: it retried for its whole uploadRetryMinutes while
rank 0, waiting for its shards, ran out of grace and exited 1 without a verdict.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
import uuid

KEY = "rlft/stop-requested"
"""Set in the process group's store by the first rank that got a stop signal (with the
group's own suffix: a store torchrun's agent shares keeps it past the group), to that
rank and the signal's wall-clock time (`<rank> <time.time()>`)."""


class PeerStop:
    """The process group's shared stop flag: set by any rank's signal, read by all."""

    def __init__(self, store, rank: int, key: str = KEY):
        self._store, self._rank, self._key = store, rank, key
        self._signals: frozenset[int] = frozenset()
        self._writer: socket.socket | None = None
        self._previous_fd = -1

    @classmethod
    def of(cls, dist) -> PeerStop | None:
        """The flag of `dist`'s process group; None in a single process. Collective: a
        suffix of rank 0's makes the key this group's alone."""
        if not dist.active:
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        suffix = dist.broadcast(uuid.uuid4().hex if dist.is_main else None)
        return cls(_get_default_store(), dist.rank, f"{KEY}/{suffix}")

    def requested(self) -> bool:
        """Whether a rank got a stop signal (rank 0's waits poll this; one store call)."""
        try:
            return bool(self._store.check([self._key]))
        except Exception:  # the store unreachable: the collectives will say why
            return False

    def seconds_since(self, longest: float) -> float | None:
        """Seconds since the group's first stop signal (by the wall clock: the ranks'
        monotonic clocks are their own machines'); None before any, or unreadable, or
        past `longest` (the grace period: its watchdog would have ended the signalled
        rank by then, so this rank's clock is ahead of that one's, not the time short)."""
        try:
            if not self._store.check([self._key]):
                return None
            at = float(self._store.get(self._key).decode().split()[1])
        except Exception:  # unreachable, or a value of an older trainer: rank alone
            return None
        since = max(0.0, time.time() - at)
        return since if since <= longest else None

    def watch(self, signals: tuple[int, ...]) -> None:
        """Set the flag as soon as one of `signals` (whose handlers are installed) reaches
        this process. From the main thread, as every signal call must be."""
        if threading.current_thread() is not threading.main_thread():
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # set_wakeup_fd requires it
        self._signals, self._writer = frozenset(signals), writer
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._read, args=(reader,), name="peer-stop", daemon=True).start()

    def _read(self, reader: socket.socket) -> None:
        with reader:
            while data := _receive(reader):
                if self._signals.intersection(data):
                    with contextlib.suppress(Exception):  # the first signal's time stays
                        self._store.compare_set(self._key, "", f"{self._rank} {time.time()!r}")

    def close(self) -> None:
        """Stop watching (the reader ends at the writer's close); idempotent."""
        if self._writer is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(self._previous_fd)
        self._writer.close()
        self._writer = None


def _receive(reader: socket.socket) -> bytes:
    try:
        return reader.recv(64)
    except OSError:
        return b""
