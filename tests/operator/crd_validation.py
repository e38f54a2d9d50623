"""Validate a custom resource against its CRD the way kube-apiserver does, offline.

The emulated API server has no schema validation of its own; this module adds it (the
emulator calls it on every create/update of a custom resource) and the tests call it
directly. Three layers, as in kube-apiserver:

1. unknown fields (pruning): an error with fieldValidation=Strict, else dropped with a
   warning, unless `x-kubernetes-preserve-unknown-fields`;
2. the OpenAPI v3 schema, checked with `jsonschema` (Draft 4, whose boolean
   exclusiveMinimum is OpenAPI's), after mapping `nullable` and `x-kubernetes-int-or-string`;
3. the CEL rules (`x-kubernetes-validations`), evaluated with cel-python, `oldSelf` bound
   on updates for transition rules.

Errors read like the API server's: `spec.trainer.replicas.min: Invalid value: 0: …`.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema


@dataclass(frozen=True)
class Problem:
    field: str
    message: str
    reason: str = "FieldValueInvalid"

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _to_json_schema(node: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 (structural) → JSON schema Draft 4, unknown fields left to pruning."""
    out: dict[str, Any] = {}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif "type" in node:
        out["type"] = [node["type"], "null"] if node.get("nullable") else node["type"]
    for key in (
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "required",
        "minProperties",
        "maxProperties",
    ):
        if key in node:
            out[key] = node[key]
    if "enum" in node:
        out["enum"] = list(node["enum"]) + ([None] if node.get("nullable") else [])
    if "properties" in node:
        out["properties"] = {k: _to_json_schema(v) for k, v in node["properties"].items()}
    if "additionalProperties" in node and isinstance(node["additionalProperties"], dict):
        out["additionalProperties"] = _to_json_schema(node["additionalProperties"])
    if "items" in node:
        out["items"] = _to_json_schema(node["items"])
    return out


def _path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else ("." if text else "") + str(part)
    return text or "<root>"


def prune(value: Any, schema: dict[str, Any], where: str = "") -> tuple[Any, list[str]]:
    """Drop fields the schema does not declare; returns (pruned copy, unknown field paths)."""
    unknown: list[str] = []
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
            return value, unknown
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = f"{where}.{key}" if where else key
            if props is not None and key in props:
                out[key], more = prune(item, props[key], sub)
                unknown += more
            elif isinstance(extra, dict):
                out[key], more = prune(item, extra, sub)
                unknown += more
            elif props is None or schema.get("x-kubernetes-preserve-unknown-fields"):
                out[key] = item
            else:
                unknown.append(sub)
        return out, unknown
    if isinstance(value, list) and "items" in schema:
        out_list = []
        for i, item in enumerate(value):
            pruned, more = prune(item, schema["items"], f"{where}[{i}]")
            out_list.append(pruned)
            unknown += more
        return out_list, unknown
    return value, unknown


@functools.lru_cache(maxsize=256)
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _cel(value: Any, old: Any, schema: dict[str, Any], where: str) -> list[Problem]:
    problems: list[Problem] = []
    if old is not None and value == old:
        # Ratcheting (kube-apiserver ≥ 1.30): rules on a value the update left unchanged
        # are not evaluated again, so a status write does not re-check the spec.
        return problems
    converted: dict[str, Any] = {}  # self and oldSelf, converted once for all the rules
    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule["rule"]
        uses_old = "oldSelf" in text
        if uses_old and old is None:
            continue  # transition rules only run on updates
        if not converted:
            converted["self"] = celpy.json_to_cel(value)
        if uses_old and "oldSelf" not in converted:
            converted["oldSelf"] = celpy.json_to_cel(old)
        activation = {"self": converted["self"]}
        if uses_old:
            activation["oldSelf"] = converted["oldSelf"]
        try:
            ok = bool(_program(text).evaluate(activation))
        except Exception as error:  # a rule that cannot evaluate rejects, as in the API server
            ok = False
            message = f"{rule.get('message') or text} (evaluation error: {error})"
        else:
            message = rule.get("message") or f"failed rule: {text}"
        if not ok:
            field = where + rule.get("fieldPath", "") if where else rule.get("fieldPath", "")
            shown = json.dumps(value) if not isinstance(value, dict | list) else '"object"'
            problems.append(
                Problem(field.lstrip(".") or "<root>", f"Invalid value: {shown}: {message}")
            )
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub_schema = props.get(key) or (extra if isinstance(extra, dict) else None)
            if sub_schema is None or item is None:
                continue
            sub_old = old.get(key) if isinstance(old, dict) else None
            problems += _cel(item, sub_old, sub_schema, f"{where}.{key}" if where else key)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += _cel(item, None, schema["items"], f"{where}[{i}]")
    return problems


def validate(
    obj: dict[str, Any],
    schema: dict[str, Any],
    old: dict[str, Any] | None = None,
    field_validation: str = "Strict",
) -> tuple[dict[str, Any], list[Problem], list[str]]:
    """Check a custom resource. Returns (the pruned object, problems, warnings); the object
    is acceptable when there are no problems."""
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    pruned, unknown = prune(body, schema)
    problems: list[Problem] = []
    warnings: list[str] = []
    for field in unknown:
        if field_validation == "Strict":
            problems.append(Problem(field, f'unknown field "{field}"', "FieldValueInvalid"))
        elif field_validation != "Ignore":
            warnings.append(f'unknown field "{field}"')
    validator = jsonschema.Draft4Validator(_to_json_schema(schema))
    for error in sorted(validator.iter_errors(pruned), key=lambda e: list(e.absolute_path)):
        where = _path(error.absolute_path)
        shown = (
            json.dumps(error.instance)
            if not isinstance(error.instance, dict | list)
            else '"object"'
        )
        problems.append(Problem(where, f"Invalid value: {shown}: {error.message}"))
    if not problems:
        full = {**{k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}, **pruned}
        old_full = copy.deepcopy(old) if old is not None else None
        problems += _cel(full, old_full, schema, "")
    result = {**{k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}, **pruned}
    return result, problems, warnings


_program("true")  # cel-python raises the recursion limit on first use: do it at import
