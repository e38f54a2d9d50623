"""A SIGTERM that reaches a trainer rank before training is set up.

The training loop's own handler (`checkpoint.emergency.GracefulStop`) exists only once the
model is built and sharded. Before it, SIGTERM's default action killed a rank that was
importing torch, joining its process group, loading its model or data, without a word:
the operator saw exit 1 (torchrun's) and a log tail. There is nothing to checkpoint then,
so the rank ends at once, and `on_sigterm` writes a verdict that says so.

The signal is acted on by a thread woken through the signal wakeup fd, not in the Python
handler: Python runs a handler only between bytecodes of the main thread, and a rank
waiting in the process group's C++ rendezvous for a peer that never comes runs none for
minutes. GracefulStop takes SIGTERM over for good (`hand_over`): once training is set up,
a SIGTERM is its to handle, and after it a signal's default action again, never this
module's "nothing had run".

After the run, GracefulStop puts back the handler from before this module's: with
`on_late_sigterm`, not the default action, which killed a rank that was writing its
verdict (torchrun stopping the survivors of a rank that died) before it wrote it. A late
SIGTERM leaves the rank `LATE_GRACE_SECONDS` to end on its own, then calls it.

No torch here: it is installed before torch is imported.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType

_current: StopWhileStarting | None = None
LATE_GRACE_SECONDS = 10.0
"""How long a rank that got SIGTERM after its run may still take to end on its own."""


class StopWhileStarting:
    """Until `hand_over`, a SIGTERM calls `on_sigterm` on a thread of its own (it is to
    end the process: the main thread may be anywhere, blocked in a C call included)."""

    def __init__(
        self, on_sigterm: Callable[[], None], on_late_sigterm: Callable[[], None] | None = None
    ) -> None:
        self.on_sigterm = on_sigterm
        self.on_late_sigterm = on_late_sigterm
        """Called (on a timer's thread) when a SIGTERM after the run did not see the rank
        end within LATE_GRACE_SECONDS (None: the default action, as before this)."""
        self._late: threading.Timer | None = None
        self.received = False
        """A SIGTERM arrived (the main thread's handler ran)."""
        self.acted = False
        """The thread took it in hand (`on_sigterm` called)."""
        self._writer: socket.socket | None = None
        self._previous_fd = -1
        self._previous_handler: signal.Handlers | Callable[[int, FrameType | None], object] = (
            signal.SIG_DFL
        )

    def install(self) -> StopWhileStarting:
        """From the main thread (elsewhere nothing changes)."""
        global _current
        if threading.current_thread() is not threading.main_thread():
            return self
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # set_wakeup_fd requires it
        self._writer = writer
        # The fd first: a SIGTERM between the two calls meets the default action, where
        # one after the handler but before the fd would wake nothing.
        self._previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        # A Python handler makes the C one write the wakeup fd, which wakes the thread.
        previous = signal.signal(signal.SIGTERM, self._noted)
        # None: a handler set outside Python, which cannot be restored; the default then.
        self._previous_handler = signal.SIG_DFL if previous is None else previous
        threading.Thread(
            target=self._watch, args=(reader,), name="stop-while-starting", daemon=True
        ).start()
        _current = self
        return self

    def uninstall(self) -> None:
        """SIGTERM's handler back to the one before, unless another replaced this one, and
        the wakeup fd too; the thread ends. From the main thread; idempotent."""
        global _current
        if self._writer is None or threading.current_thread() is not threading.main_thread():
            return
        if self._installed():
            signal.signal(signal.SIGTERM, self._previous_handler)
        signal.set_wakeup_fd(self._previous_fd)
        self._writer.close()
        self._writer = None
        if _current is self:
            _current = None

    def _installed(self) -> bool:
        return signal.getsignal(signal.SIGTERM) == self._noted

    def _noted(self, signum: int, frame: FrameType | None) -> None:
        """The thread acts on the signal (see the module's docstring); noted here too, so
        that one the thread has not reached when GracefulStop takes over is passed on to
        it (`hand_over`) rather than lost."""
        self.received = True

    def _after_the_run(self) -> signal.Handlers | Callable[[int, FrameType | None], object]:
        """SIGTERM's handler once GracefulStop is done with it."""
        return self._previous_handler if self.on_late_sigterm is None else self._late_sigterm

    def _late_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._late is None and self.on_late_sigterm is not None:
            self._late = threading.Timer(LATE_GRACE_SECONDS, self.on_late_sigterm)
            self._late.daemon = True
            self._late.start()

    def _watch(self, reader: socket.socket) -> None:
        # Read until `uninstall` closes the writer: a reader gone before it would turn the
        # wakeup writes of later signals into errors printed by the interpreter.
        with reader:
            while data := _receive(reader):
                # Not once another handler has replaced this one: the signal is its own.
                if signal.SIGTERM in data and self._writer is not None and self._installed():
                    self.acted = True
                    self.on_sigterm()


def _receive(reader: socket.socket) -> bytes:
    try:
        return reader.recv(64)
    except OSError:
        return b""


def hand_over(previous: dict[int, object]) -> None:
    """Training is set up: SIGTERM is the handler's just installed, whose `previous`
    handlers (what it restores when it is done) get the one from before this module's in
    place of it. From the main thread, after the new handler is installed: a SIGTERM on
    the way is never lost to a default action in between."""
    starting = _current
    if starting is None:
        return
    if previous.get(signal.SIGTERM) == starting._noted:
        previous[signal.SIGTERM] = starting._after_the_run()
    starting.uninstall()
    if starting.received and not starting.acted:
        # Arrived while the thread waited for the GIL, and the new handler is installed
        # now, so the thread will not act: the new handler gets it (a stop, not lost).
        signal.raise_signal(signal.SIGTERM)
