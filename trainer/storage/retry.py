"""Retries with exponential backoff, until a deadline.

Pure over an injected clock and sleep so that the schedule is tested without waiting.
Only errors marked transient are retried; a permanent one is raised at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from rlft.trainer.storage.errors import StorageError
from rlft.trainer.telemetry import liveness

T = TypeVar("T")


def backoff_delays(
    base: float = 0.5, cap: float = 30.0, factor: float = 2.0, jitter: float = 0.0
) -> Iterator[float]:
    """Delays base, base·factor, … capped at `cap`; with `jitter` in [0, 1) each delay is
    lowered by up to that fraction so that many ranks do not retry in lock step."""
    if base <= 0 or cap < base or factor < 1 or not 0 <= jitter < 1:
        raise ValueError("need 0 < base ≤ cap, factor ≥ 1 and 0 ≤ jitter < 1")
    delay = base
    while True:
        yield delay * (1 - jitter * random.random())
        delay = min(cap, delay * factor)


def is_transient(error: BaseException) -> bool:
    """Whether retrying can help."""
    return isinstance(error, StorageError) and error.transient


def with_retries(
    call: Callable[[], T],
    *,
    deadline_s: float,
    base: float = 0.5,
    cap: float = 30.0,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    until: Callable[[], float] | None = None,
) -> T:
    """`call()`, retried on transient errors until `deadline_s` seconds have passed.

    `on_retry(attempt, error, delay)` is told about every retry (for logs and counters).
    The last error is raised when the deadline would be passed by the next wait. `until`,
    read around each wait, is a second deadline on `clock` that may move closer while
    retrying (a stop signal bounding a save in flight to its grace period): past it, no
    further attempt is made."""
    start = clock()
    delays = backoff_delays(base, cap, jitter=0.2)
    attempt = 0
    while True:
        attempt += 1
        try:
            return call()
        except Exception as error:
            if not is_transient(error):
                raise
            delay = next(delays)
            if clock() - start + delay > deadline_s or (
                until is not None and clock() + delay > until()
            ):
                raise
            if on_retry is not None:
                on_retry(attempt, error, delay)
            # Retrying within a deadline is slow, not stuck (counts only on the loop's thread).
            liveness.beat(f"retrying a storage call (attempt {attempt})")
            sleep(delay)
            if until is not None and clock() >= until():
                raise  # the deadline came closer during the wait
