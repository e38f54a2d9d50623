"""The staleness gate: pure rules over plain numbers (no torch, no I/O).

Policy version v = the number of optimizer updates applied to the weights that generated
a sample. The trainer, holding weights of version V, may train on it only if
`V - v <= maxStaleness` (0 = synchronous, on-policy). Two rules keep that true:

- `may_start`: batch b (0-based) may start generating once the weights published after
  step b - maxStaleness - 1 are on the instances, so in normal operation nothing is late;
- `gate`: at training time every sample is checked anyway (an instance that missed a
  weight update serves an old version); late ones are dropped and counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


def may_start(batch: int, steps_released: int, max_staleness: int) -> bool:
    """Whether batch `batch` may start: steps 0 .. batch - max_staleness - 1 have finished
    and their weights were published."""
    if batch < 0 or steps_released < 0 or max_staleness < 0:
        raise ValueError("batch, steps_released and max_staleness must be ≥ 0")
    return steps_released >= batch - max_staleness


class Releases:
    """The policy version published after each finished step, as a list indexed by step
    that keeps only the last `max_staleness + 2` entries: `required_step` never reaches
    further back (the producer is never more than `max_staleness` batches ahead of the
    steps released), and a weeks-long run finishes millions of steps."""

    def __init__(self, max_staleness: int):
        self.count = 0
        self._recent: deque[int] = deque(maxlen=max_staleness + 2)

    def append(self, version: int) -> None:
        self._recent.append(version)
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, step: int) -> int:
        first = self.count - len(self._recent)
        if not first <= step < self.count:
            raise IndexError(f"step {step} is not among the kept {first}..{self.count - 1}")
        return self._recent[step - first]


def required_step(batch: int, max_staleness: int) -> int | None:
    """The step whose published weights batch `batch` must wait for (None: none)."""
    step = batch - max_staleness - 1
    return step if step >= 0 else None


class FutureVersionError(RuntimeError):
    """A sample tagged with a version the trainer has not reached: weights of another
    timeline are being served. Not a ValueError (the trainer's exit code for a bad job,
    permanent): a restart republishes the weights, so it is retryable."""


@dataclass(frozen=True)
class GateResult:
    keep: list[int]
    """Indices of the samples that may be trained on, in their original order."""
    dropped: list[int]
    """Indices of the samples that are too stale."""
    staleness: list[int]
    """Staleness (V - v) of each kept sample."""

    @property
    def staleness_mean(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)


def gate(versions: Sequence[int], trainer_version: int, max_staleness: int) -> GateResult:
    """Split samples (by the policy version that produced each) into trainable and too
    stale. A version newer than the trainer's is a bug upstream, not a sample to train."""
    if max_staleness < 0:
        raise ValueError("max_staleness must be ≥ 0")
    keep, dropped, lags = [], [], []
    for index, version in enumerate(versions):
        lag = trainer_version - version
        if lag < 0:
            raise FutureVersionError(
                f"sample {index} has policy version {version}, newer than the trainer's "
                f"{trainer_version}: versions must only come from published weights"
            )
        if lag <= max_staleness:
            keep.append(index)
            lags.append(lag)
        else:
            dropped.append(index)
    return GateResult(keep, dropped, lags)
