"""The configuration reference, generated from the job file's pydantic models.

`.venv/bin/python -m rlft.trainer.config.docs > docs/configuration.md` (it prints the
reference); a test fails when the file is stale, so the reference can never drift from the
code.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rlft.trainer.config import RLFineTuneSpec, Section

HEADER = """# Configuration reference

Generated from `rlft.trainer.config` by
`.venv/bin/python -m rlft.trainer.config.docs > docs/configuration.md`; do not edit.
Every field of an `RLFineTune` manifest's `spec`, with its type, default and bounds.
Fields marked *(Kubernetes only)* are part of the job file but ignored by `rlft train`.
"""


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a constrained type inside a union: its base type
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "map"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: FieldInfo) -> str:
    counted = "items" if _is_collection(field.annotation) else "characters"
    words = {
        "ge": "≥",
        "gt": ">",
        "le": "≤",
        "lt": "<",
        "min_length": f"min {counted}",
        "max_length": f"max {counted}",
    }
    parts = []
    for item in field.metadata:
        for attr, sign in words.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def _is_collection(annotation: Any) -> bool:
    """A list or map, also when optional: its length bounds count items."""
    if typing.get_origin(annotation) in (list, dict):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_collection(a) for a in typing.get_args(annotation))
    return False


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return ""
    return "" if value is None else f"`{value!r}`"


def _rows(model: type[Section], prefix: str) -> list[str]:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{field.alias or name}"
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(
            f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | "
            f"{_bounds(field)} | {description} |"
        )
        nested += [
            (s, key + ("[]" if in_list else "")) for s, in_list in _sections(field.annotation)
        ]
    return rows, nested


def _sections(annotation: Any, in_list: bool = False) -> list[tuple[type[Section], bool]]:
    """The sections a field holds, each with whether it is an item of a list (a map's
    values are documented with the map)."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return [(annotation, in_list)]
    origin = typing.get_origin(annotation)
    if origin is dict:
        return []
    found = []
    for arg in typing.get_args(annotation):
        found += _sections(arg, in_list or origin is list)
    return found


def render() -> str:
    lines = [HEADER]
    queue: list[tuple[type[Section], str]] = [(RLFineTuneSpec, "spec")]
    while queue:
        model, prefix = queue.pop(0)
        rows, nested = _rows(model, prefix)
        doc = " ".join((model.__doc__ or "").split())
        lines += [f"## `{prefix}`", "", doc, "", "| field | type | default | bounds | meaning |"]
        lines += ["|---|---|---|---|---|", *rows, ""]
        queue.extend(nested)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
