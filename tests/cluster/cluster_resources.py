"""Kubernetes resource quantities and what a pod asks for (the scheduler fits requests,
the kubelet enforces memory limits)."""

from __future__ import annotations

import re
from typing import Any

_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")


def quantity(value: Any) -> float:
    """'500m' → 0.5, '1Gi' → 1073741824, 2 → 2."""
    if isinstance(value, int | float):
        return float(value)
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = float(match.group(1)), match.group(2) or ""
    if suffix == "m":
        return number / 1000
    return number * _SUFFIX[suffix]


def pod_requests(pod: dict[str, Any]) -> dict[str, float]:
    """Summed container requests (a limit stands for a missing request, as in Kubernetes)."""
    total: dict[str, float] = {}
    for container in pod["spec"].get("containers", []):
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in asked.items():
            total[name] = total.get(name, 0.0) + quantity(value)
    return total


def memory_limit(container: dict[str, Any]) -> int | None:
    limits = (container.get("resources") or {}).get("limits") or {}
    return int(quantity(limits["memory"])) if "memory" in limits else None
