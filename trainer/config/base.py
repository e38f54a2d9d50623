"""The base class of every job-file section (kept apart so that section modules can
share it without importing each other)."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import AliasGenerator, BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class Section(BaseModel):
    """Base of every section: camelCase keys as in Kubernetes, unknown keys rejected."""

    model_config = ConfigDict(
        alias_generator=AliasGenerator(alias=to_camel),
        validate_by_name=True,
        validate_by_alias=True,
        strict=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )


def checked(value: str | None, problem: Callable[[str], str | None]) -> str | None:
    """`value` if `problem` finds nothing wrong with it; else the problem, as a field error."""
    found = None if value is None else problem(value)
    if found:
        raise ValueError(found)
    return value
