"""Reading job files: YAML as Kubernetes reads it, validated into an `RLFineTune`, with
every bad field named in the words a YAML author uses."""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlft.trainer.config.job import RLFineTune


class JobFileError(Exception):
    """A job file that cannot be used; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _describe(error: dict[str, Any]) -> str:
    """One human line for one pydantic error, in the words a YAML author uses."""
    ctx = error.get("ctx") or {}
    kind = error["type"]
    bound_words = {
        "greater_than_equal": ("ge", "≥"),
        "greater_than": ("gt", ">"),
        "less_than_equal": ("le", "≤"),
        "less_than": ("lt", "<"),
    }
    if kind in bound_words:
        key, sign = bound_words[kind]
        return f"must be {sign} {ctx[key]}"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field (check its spelling; keys are camelCase)"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    if kind in ("too_short", "too_long"):
        return error["msg"].lower()
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"]))
    return error["msg"][0].lower() + error["msg"][1:]


_TYPE_TAGS = {"str", "int", "float", "bool", "[key]", "none"}
_INTERNAL_TAGS = ("function-", "literal[", "union[", "json-or-python", "lax-", "strict-")


def _location(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _TYPE_TAGS or item.startswith(_INTERNAL_TAGS):
            continue  # pydantic's names for union members and validators, not fields
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or "(top level)"


def problems_of(error: ValidationError) -> list[str]:
    """Turn a pydantic ValidationError into `field.path: what is wrong` lines, one per
    field (a value failing every member of a union is one problem, not one per member)."""
    lines: dict[str, str] = {}
    for e in error.errors(include_url=False):
        where = _location(e["loc"])
        lines.setdefault(where, f"{where}: {_describe(e)}")
    return list(lines.values())


def parse_job(document: Any, source: str = "<job>") -> RLFineTune:
    """Validate a loaded YAML/JSON document; raise JobFileError naming every bad field."""
    if not isinstance(document, dict):
        raise JobFileError(
            source, ["(top level): must be a mapping with apiVersion, kind, metadata, spec"]
        )
    try:
        # Files must use the camelCase keys Kubernetes will check; snake_case names are
        # for Python code constructing sections directly.
        return RLFineTune.model_validate(document, by_alias=True, by_name=False)
    except ValidationError as error:
        raise JobFileError(source, problems_of(error)) from None


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, which reads `1e-3` as a string; Kubernetes reads YAML
    1.2, where it is a number. Job files must mean the same thing in both. A key given
    twice in one mapping is refused (PyYAML keeps the last one without a word: a second
    `algorithm:` silently replaced the first; kubectl refuses duplicate fields too)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # a list or mapping as a key: PyYAML's error
                return super().construct_mapping(node, deep=deep)
            if key in seen and key != "<<":
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """Parse YAML the way Kubernetes does for numbers (YAML 1.2 floats)."""
    return yaml.load(text, Loader=_Yaml12Loader)


def load_job(path: str | Path) -> RLFineTune:
    """Read and validate a job file (YAML)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise JobFileError(str(path), [f"cannot read the file: {error.strerror}"]) from None
    except UnicodeDecodeError as error:
        line = error.object[: error.start].count(b"\n") + 1
        raise JobFileError(
            str(path),
            [f"line {line}: not UTF-8 (byte 0x{error.object[error.start]:02x}); save it as UTF-8"],
        ) from None
    try:
        document = read_yaml(text)
    except RecursionError:
        raise JobFileError(str(path), ["not a job file: nested too deeply"]) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark else ""
        raise JobFileError(
            str(path), [f"{where}not valid YAML ({getattr(error, 'problem', error)})"]
        ) from None
    return parse_job(document, str(path))


def dump_job(job: RLFineTune) -> dict[str, Any]:
    """The job as a plain document with Kubernetes-style keys (for rendered configs)."""
    return job.model_dump(mode="json", by_alias=True, exclude_none=True)
