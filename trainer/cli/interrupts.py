"""Holding a Ctrl-C back while torch is imported.

Python turns a Ctrl-C into a KeyboardInterrupt raised wherever the main thread happens to
be. While torch imports, that can be inside numpy's import, which torch's C++ start-up
runs and whose failure it clears (it takes numpy for absent): the interrupt was lost, and
`rlft train` went on to train to the end as if no key had been pressed. Inside
`deferred_interrupt()` a Ctrl-C only sets a flag; it is raised as the block ends, where
the command's own handling of it stands.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


class InterruptedWhileStarting(KeyboardInterrupt):
    """A Ctrl-C held back by `deferred_interrupt`: nothing had run yet."""


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """A Ctrl-C inside the block is raised (InterruptedWhileStarting, a KeyboardInterrupt)
    when the block ends, not in the middle of the code it runs. Elsewhere than the main
    thread, or where SIGINT is not Python's default handler (ignored, or a command's
    own), nothing changes."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed: list[bool] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        pressed.append(True)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise InterruptedWhileStarting
