"""Faults planted on purpose, for drills and tests of the collapse guard and the trainer
pods' liveness: the real loop runs, with the gradient scaled on chosen steps as a loss
spike or a blow-up would, or one rank hanging as in a wedged collective.

Set `RLFT_PLANT_FAULTS` to a JSON list of faults:

- `{"kind": "grad_scale", "from": 25, "to": 26, "factor": 100}`: every gradient scaled
  by `factor` on steps `from` ≤ s < `to`;
- `{"kind": "hang", "rank": 1, "at": 8}`: rank `rank` stops for good at step `at` of the
  job's algorithm, after its batch is drawn and before the step's first collective, so
  its peers block in that collective: a hung rank, for its liveness probe to find. It
  hangs only in gang attempt `attempt` (default 0: the first gang the operator starts;
  `$RLFT_GANG_ATTEMPT`, the status's gangAttempt, is 0 when unset), so the restarted gang
  runs through however far back its checkpoint is;
- `{"kind": "error", "rank": 0, "at": 5}`: rank `rank` raises a ValueError at step `at`
  of the job's algorithm (where a hang would stop), as a bug or a library's error on
  some batch would, in every gang attempt;
- `{"kind": "pause", "worldSize": 2, "after": 3}`: every rank of a gang of world size
  `worldSize` pauses before the step after the `after` steps its process ran, beating
  its liveness as a long step would, until it is asked to stop (torchrun sends SIGTERM
  when an elastic gang grows: the rank then stops as from any step) or `limitSeconds`
  (default 600) pass: a drill of an elastic gang that grows back while it trains,
  whatever the machine's speed.

Nothing is planted when it is unset; a malformed value is an error, not ignored.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV = "RLFT_PLANT_FAULTS"
GANG_ENV = "RLFT_GANG_ATTEMPT"
"""Set by the operator on trainer pods: which gang attempt (status.gangAttempt) this is."""


@dataclass(frozen=True)
class GradScale:
    start: int
    stop: int
    factor: float

    def active(self, step: int) -> bool:
        return self.start <= step < self.stop


@dataclass(frozen=True)
class Hang:
    rank: int
    at: int
    attempt: int = 0

    def active(self, rank: int, step: int, attempt: int) -> bool:
        return (rank, step, attempt) == (self.rank, self.at, self.attempt)


@dataclass(frozen=True)
class Error:
    rank: int
    at: int


@dataclass(frozen=True)
class Pause:
    world_size: int
    after: int
    limit_s: float = 600.0


Fault = GradScale | Hang | Error | Pause


def _parse(item: dict) -> Fault:
    if item["kind"] == "grad_scale":
        return GradScale(int(item["from"]), int(item["to"]), float(item["factor"]))
    if item["kind"] == "hang":
        return Hang(int(item["rank"]), int(item["at"]), int(item.get("attempt", 0)))
    if item["kind"] == "error":
        return Error(int(item["rank"]), int(item["at"]))
    if item["kind"] == "pause":
        limit = float(item.get("limitSeconds", 600))
        return Pause(int(item["worldSize"]), int(item["after"]), limit)
    raise ValueError(f"unknown kind {item['kind']!r}")


def planted_from_env(environ: dict[str, str] | None = None) -> list[Fault]:
    text = (os.environ if environ is None else environ).get(ENV)
    if not text:
        return []
    try:
        return [_parse(item) for item in json.loads(text)]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{ENV}: expected a JSON list of grad_scale, hang, error and pause faults ({error})"
        ) from None


def apply(faults: list[Fault], step: int, parameters) -> None:
    """Scale every gradient by the factors of the grad_scale faults active at `step`."""
    factor = 1.0
    for fault in faults:
        if isinstance(fault, GradScale) and fault.active(step):
            factor *= fault.factor
    if factor != 1.0:
        with torch.no_grad():
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(factor)


def operator_gang_attempt(environ: dict[str, str] | None = None) -> int | None:
    """The gang attempt the operator gave this trainer pod; None outside the operator."""
    value = (os.environ if environ is None else environ).get(GANG_ENV, "")
    return int(value) if value.isdigit() else None


def gang_attempt(environ: dict[str, str] | None = None) -> int:
    """`operator_gang_attempt`, 0 outside the operator (a planted fault's default)."""
    attempt = operator_gang_attempt(environ)
    return 0 if attempt is None else attempt


def planted_hang(
    faults: list[Fault], rank: int, step: int, environ: dict[str, str] | None = None
) -> Hang | None:
    """The hang planted for this rank, step and gang attempt, if any."""
    attempt = gang_attempt(environ)
    return next((f for f in faults if isinstance(f, Hang) and f.active(rank, step, attempt)), None)


def hang_if_planted(faults: list[Fault], rank: int, step: int) -> None:
    """Never returns when a hang is planted here: sleeps without a beat, as a rank
    blocked in a collective or a weight sync would, until it is killed."""
    hang = planted_hang(faults, rank, step)
    if hang is None:
        return
    print(
        f"rlft: planted fault: rank {rank} hangs at step {step} (gang attempt {hang.attempt})",
        file=sys.stderr,
        flush=True,
    )
    while True:
        time.sleep(3600)


def raise_if_planted(faults: list[Fault], rank: int, step: int) -> None:
    """Raise the ValueError planted for this rank and step, if any."""
    if any(isinstance(f, Error) and (f.rank, f.at) == (rank, step) for f in faults):
        raise ValueError(f"planted fault: rank {rank} fails at step {step}")


_steps_run = 0
"""Steps this process began (a pause counts its `after` from the process's start)."""


def pause_if_planted(
    faults: list[Fault],
    world_size: int,
    rank: int,
    step: int,
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Pause here, beating, when a pause is planted for this world size and this process
    has run its `after` steps; returns once `stopping()` or after the pause's limit (a
    pause deaf to the SIGTERM was SIGKILLed at the end of torchrun's wait)."""
    global _steps_run
    _steps_run += 1
    pause = next((f for f in faults if isinstance(f, Pause) and f.world_size == world_size), None)
    if pause is None or _steps_run != pause.after + 1:
        return
    from rlft.trainer.telemetry import liveness

    print(
        f"rlft: planted fault: rank {rank} of world size {world_size} pauses at step {step}",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + pause.limit_s
    while time.monotonic() < deadline and not stopping():
        liveness.beat(f"planted pause at step {step}")
        time.sleep(1)
