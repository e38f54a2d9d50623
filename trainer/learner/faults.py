"""Faults planted on purpose, for drills and tests of the collapse guard: the real loop
runs, with the gradient scaled on chosen steps as a loss spike or a blow-up would.

Set `RLFT_PLANT_FAULTS` to a JSON list, e.g.
`[{"kind": "grad_scale", "from": 25, "to": 26, "factor": 100}]` (steps `from` ≤ s < `to`).
Nothing is planted when it is unset; a malformed value is an error, not ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

ENV = "RLFT_PLANT_FAULTS"


@dataclass(frozen=True)
class GradScale:
    start: int
    stop: int
    factor: float

    def active(self, step: int) -> bool:
        return self.start <= step < self.stop


def planted_from_env() -> list[GradScale]:
    text = os.environ.get(ENV)
    if not text:
        return []
    try:
        items = json.loads(text)
        faults = [
            GradScale(int(i["from"]), int(i["to"]), float(i["factor"]))
            for i in items
            if i["kind"] == "grad_scale"
        ]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{ENV}: expected a JSON list of grad_scale faults ({error})") from None
    if len(faults) != len(items):
        raise ValueError(f"{ENV}: only kind grad_scale is known")
    return faults


def apply(faults: list[GradScale], step: int, parameters) -> None:
    """Scale every gradient by the factors of the faults active at `step`."""
    factor = 1.0
    for fault in faults:
        if fault.active(step):
            factor *= fault.factor
    if factor != 1.0:
        with torch.no_grad():
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(factor)
