"""When to checkpoint: every `intervalSteps` steps and at least every `intervalMinutes`.

Pure over an injected clock. A save that falls due while the previous one is still in
flight stays pending and happens at the first step after that one finished, so slow
storage delays checkpoints instead of stalling training or piling them up.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class SavePolicy:
    """Decides, step by step, whether a checkpoint is due."""

    def __init__(
        self,
        interval_steps: int,
        interval_minutes: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if interval_steps < 1 or interval_minutes <= 0:
            raise ValueError("intervalSteps must be ≥ 1 and intervalMinutes > 0")
        self.interval_steps = interval_steps
        self.interval_s = interval_minutes * 60.0
        self._clock = clock
        self._last_time = clock()
        self.pending = False

    def due(self, step: int) -> bool:
        """Whether a save is due after optimizer step `step` (steps count from 1).

        Step-based saves fall on multiples of intervalSteps, so a resumed run saves at
        the same steps as an uninterrupted one.
        """
        if step % self.interval_steps == 0 or self._clock() - self._last_time >= self.interval_s:
            self.pending = True
        return self.pending

    def saved(self) -> None:
        """A save was started: nothing is pending, the minute interval restarts."""
        self.pending = False
        self._last_time = self._clock()
