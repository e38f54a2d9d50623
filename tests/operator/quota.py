"""ResourceQuota admission for the emulated API server, the way kube-apiserver's
ResourceQuota plugin refuses a create (k8s.io/apiserver admission/plugin/resourcequota):

- every ResourceQuota of the namespace whose `spec.hard` names something the new object
  uses is checked; usage is what the namespace's objects use now (pods in a terminal
  phase do not count) plus the new object;
- a pod that does not say what a quota constrains (`requests.cpu` and no cpu request)
  is refused: `pods "x" is forbidden: failed quota: q: must specify requests.cpu`;
- one that would go over is refused with the real message, 403 Forbidden:
  `pods "x" is forbidden: exceeded quota: q, requested: pods=1, used: pods=2, limited: pods=2`.

Covered: object counts (`pods`, `services`, `configmaps`, `secrets`, `count/<plural>`),
`requests.*` (with the bare `cpu` and `memory` as their aliases) and `limits.*` of pods,
extended resources (`requests.nvidia.com/gpu`). Not covered: scopes, scope selectors,
PriorityClass quotas, the quota controller's status.used.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

_SUFFIXES = {
    "m": Fraction(1, 1000), "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6),
    "G": Fraction(10**9), "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30), "Ti": Fraction(2**40),
    "Pi": Fraction(2**50), "Ei": Fraction(2**60),
}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_COUNTED = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Secret": "secrets"}
_COMPUTE = ("cpu", "memory")


def quantity(value: Any) -> Fraction:
    match = _QUANTITY.match(str(value).strip())
    if match is None or match.group(2) not in _SUFFIXES:
        raise ValueError(f"quantities must match the regular expression: {value!r}")
    return Fraction(match.group(1)) * _SUFFIXES[match.group(2)]


def shown(value: Fraction) -> str:
    """Roughly resource.Quantity's String(): whole numbers bare, else in milli-units."""
    if value.denominator == 1:
        for suffix in ("Gi", "Mi", "Ki"):
            if value >= _SUFFIXES[suffix] and value % _SUFFIXES[suffix] == 0:
                return f"{value // _SUFFIXES[suffix]}{suffix}"
        return str(value.numerator)
    return f"{round(value * 1000)}m"


def _normalise(resource: str) -> str:
    return f"requests.{resource}" if resource in _COMPUTE else resource


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list((pod.get("spec") or {}).get("containers") or [])


def usage(obj: dict[str, Any], plural: str) -> dict[str, Fraction]:
    """What one object uses of a quota (requests default to limits, as the API does)."""
    out = {f"count/{plural}": Fraction(1)}
    if obj.get("kind") in _COUNTED:
        out[_COUNTED[obj["kind"]]] = Fraction(1)
    if obj.get("kind") != "Pod":
        return out
    for container in _containers(obj):
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = {**limits, **(resources.get("requests") or {})}
        for kind, values in (("requests", requests), ("limits", limits)):
            for name, value in values.items():
                key = f"{kind}.{name}"
                out[key] = out.get(key, Fraction(0)) + quantity(value)
    return out


def counts(obj: dict[str, Any]) -> bool:
    """Whether an object still uses quota (a pod that ended does not)."""
    return obj.get("kind") != "Pod" or (obj.get("status") or {}).get("phase") not in (
        "Succeeded",
        "Failed",
    )


def _missing(obj: dict[str, Any], hard: Iterable[str]) -> list[str]:
    """Compute resources a quota constrains that some container does not state."""
    if obj.get("kind") != "Pod":
        return []
    missing = set()
    for key in hard:
        kind, _, name = _normalise(key).partition(".")
        if kind not in ("requests", "limits") or name not in _COMPUTE:
            continue
        for container in _containers(obj):
            resources = container.get("resources") or {}
            stated = {**(resources.get("limits") or {})}
            if kind == "requests":
                stated |= resources.get("requests") or {}
            if name not in stated:
                missing.add(key)
    return sorted(missing)


def _pretty(values: dict[str, Fraction]) -> str:
    return ",".join(f"{k}={shown(values[k])}" for k in sorted(values))


def refusal(
    obj: dict[str, Any], plural: str, quotas: list[dict[str, Any]], existing: list[dict[str, Any]]
) -> str | None:
    """The API server's message refusing `obj` (without the `<plural> "name" is
    forbidden: ` prefix), or None when every quota admits it."""
    wanted = usage(obj, plural)
    for q in sorted(quotas, key=lambda q: q["metadata"]["name"]):
        stated = (q.get("spec") or {}).get("hard") or {}
        hard = {_normalise(k): quantity(v) for k, v in stated.items()}
        name = q["metadata"]["name"]
        missing = _missing(obj, stated)
        if missing:
            return f"failed quota: {name}: must specify {','.join(missing)}"
        relevant = {k for k in hard if k in wanted}
        if not relevant:
            continue
        used = {k: Fraction(0) for k in relevant}
        for other in existing:
            if counts(other):
                for k, v in usage(other, plural).items():
                    if k in used:
                        used[k] += v
        over = {k for k in relevant if used[k] + wanted[k] > hard[k]}
        if over:
            return (
                f"exceeded quota: {name}, requested: {_pretty({k: wanted[k] for k in over})}, "
                f"used: {_pretty({k: used[k] for k in over})}, "
                f"limited: {_pretty({k: hard[k] for k in over})}"
            )
    return None
