"""The RLFineTune CustomResourceDefinition, generated from the pydantic models.

The job file's models (`rlft.trainer.config`) and the status model (`rlft.operator.status`)
are the single source of truth; this module turns their JSON schema into a *structural*
OpenAPI v3 schema (no `$ref`, a `type` at every level, docstrings as descriptions so that
`kubectl explain` reads well) and adds what JSON schema cannot say: CEL rules
(`x-kubernetes-validations`) for the cross-field checks that pydantic does in validators
and the transition rules of `spec_changes` (what may change while a job runs), printer
columns, the status subresource and the short name.

`rlft crd` writes the result to `crds/rlfinetune.yaml`; a test fails when that file is stale.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rlft.operator.spec_changes import transition_rules
from rlft.operator.status import RLFineTuneStatus
from rlft.trainer.config import KIND, RLFineTune, RLFineTuneSpec

GROUP = "rlft.dev"
VERSION = "v1alpha1"
PLURAL = "rlfinetunes"
SINGULAR = "rlfinetune"
SHORT_NAME = "rlft"
CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_PATH = Path(__file__).resolve().parent.parent / "crds" / "rlfinetune.yaml"
REGENERATE = "rlft crd --out crds/rlfinetune.yaml"

# OpenAPI formats the API server understands; any other format pydantic emits is dropped.
_KNOWN_FORMATS = {"int32", "int64", "float", "double", "byte", "date", "date-time", "uri"}
_KEPT_KEYWORDS = (
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "enum",
    "minProperties",
    "maxProperties",
)


def _opt(path: str, field: str, default: str) -> str:
    """CEL for `path.field`, or the pydantic default when the field is absent."""
    return f"(has({path}.{field}) ? {path}.{field} : {default})"


def _default(model: type[BaseModel], field: str) -> Any:
    return model.model_fields[field].default


def _replicas_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    lo = _opt("self", "min", str(_default(model, "min")))
    hi = _opt("self", "max", str(_default(model, "max")))
    return [{"rule": f"{lo} <= {hi}", "message": "min must be ≤ max", "fieldPath": ".min"}]


def _rollout_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    gpus = _opt("self", "gpusPerInstance", str(_default(model, "gpus_per_instance")))
    tp = _opt("self", "tensorParallel", str(_default(model, "tensor_parallel")))
    ep = _opt("self", "expertParallel", str(_default(model, "expert_parallel")))
    return [
        {
            "rule": f"{gpus} == 0 || {gpus} % ({tp} * {ep}) == 0",
            "message": "gpusPerInstance must be divisible by tensorParallel × expertParallel",
            "fieldPath": ".gpusPerInstance",
        }
    ]


def _model_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    return [
        {
            "rule": "has(self.path) != has(self.init)",
            "message": "set exactly one of `path` (a local model folder) or `init`",
        }
    ]


def _data_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    source = _opt("self", "source", f"'{_default(model, 'source')}'")
    return [
        {
            "rule": f"{source} != 'jsonl' || has(self.jsonl)",
            "message": "source `jsonl` needs the `jsonl` section with a `train` file",
            "fieldPath": ".jsonl",
        },
        {
            "rule": f"{source} == 'jsonl' || !has(self.jsonl)",
            "message": "a `jsonl` section is read only with `source: jsonl`: set it, or "
            "remove the section",
            "fieldPath": ".jsonl",
        },
    ]


def _exactly_one(fields: list[str], message: str) -> list[dict[str, str]]:
    count = " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields)
    return [{"rule": f"{count} == 1", "message": message}]


def _volume_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    sources = ["persistentVolumeClaim", "configMap", "secret", "emptyDir"]
    return _exactly_one(
        sources, "set exactly one source: persistentVolumeClaim, configMap, secret or emptyDir"
    )


def _env_from_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    return _exactly_one(
        ["configMapRef", "secretRef"], "give exactly one of configMapRef and secretRef"
    )


def _pod_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    # Both lists are bounded (maxItems), which keeps the rule's estimated cost within the
    # API server's budget. The paths the operator owns are checked by pydantic only.
    mounted = (
        "!has(self.volumeMounts) || self.volumeMounts.all(m, "
        "has(self.volumes) && self.volumes.exists(v, v.name == m.name))"
    )
    return [
        {
            "rule": mounted,
            "message": "every volumeMounts[].name must name one of volumes",
            "fieldPath": ".volumeMounts",
        }
    ]


def _gang_rules(model: type[BaseModel]) -> list[dict[str, str]]:
    kind = _opt("self", "kind", f"'{_default(model, 'kind')}'")
    return [
        {
            "rule": f"{kind} != 'kueue' || has(self.queueName)",
            "message": "kind kueue needs queueName: the LocalQueue in the job's namespace",
            "fieldPath": ".queueName",
        },
        {
            "rule": f"{kind} != 'coscheduling' || !has(self.queueName)",
            "message": "kind coscheduling has no queues: remove queueName",
            "fieldPath": ".queueName",
        },
        {
            "rule": f"{kind} != 'none' || (!has(self.queueName) && !has(self.schedulerName))",
            "message": "queueName and schedulerName need a gang kind (kueue, volcano or "
            "coscheduling)",
        },
    ]


# Cross-field rules that pydantic checks in validators, as CEL, keyed by the model's name in
# the JSON schema. A unit test evaluates each against the pydantic validator on random input,
# and fails if a model named here disappears from the schema.
CEL_RULES: dict[str, Callable[[type[BaseModel]], list[dict[str, str]]]] = {
    "Replicas": _replicas_rules,
    "RolloutSpec": _rollout_rules,
    "ModelSpec": _model_rules,
    "DataSpec": _data_rules,
    "PodVolume": _volume_rules,
    "EnvFromSource": _env_from_rules,
    "PodCustomisation": _pod_rules,
    "GangSpec": _gang_rules,
}


CHECKPOINT_URI_MESSAGE = (
    "spec.checkpoint.uri: set an s3:// location. On Kubernetes the checkpoints, the weights "
    "the rollout pods load and the final model must outlive the pods and be reachable from "
    "all of them (a file:// location or the default local folder belongs to one pod)"
)
WEIGHTS_URI_MESSAGE = (
    "spec.rollout.weightsUri: the rollout pods cannot see a file:// location; leave it unset "
    "(weights go under spec.checkpoint.uri) or use s3://"
)


def _kubernetes_rules() -> list[dict[str, str]]:
    """What only a cluster needs (locally a folder does): every pod must reach the
    checkpoints, the published weights and the final model, and they must outlive pods.
    `cluster_problems` is the same check in Python: change them together."""
    uri = "(has(self.spec.checkpoint) && has(self.spec.checkpoint.uri) ? "
    uri += "self.spec.checkpoint.uri : '')"
    weights = "(has(self.spec.rollout) && has(self.spec.rollout.weightsUri) ? "
    weights += "self.spec.rollout.weightsUri : 's3://')"
    return [
        {
            "rule": f"{uri}.startsWith('s3://')",
            "message": CHECKPOINT_URI_MESSAGE,
            "fieldPath": ".spec.checkpoint.uri",
        },
        {
            "rule": f"{weights}.startsWith('s3://')",
            "message": WEIGHTS_URI_MESSAGE,
            "fieldPath": ".spec.rollout.weightsUri",
        },
    ]


def cluster_problems(job: RLFineTune) -> list[str]:
    """What the API server refuses by the rules of `_kubernetes_rules`, for a job that
    passed pydantic: `rlft plan` has no API server to ask, and must not plan a job that
    `kubectl apply` would refuse."""
    problems = []
    if not (job.spec.checkpoint.uri or "").startswith("s3://"):
        problems.append(CHECKPOINT_URI_MESSAGE)
    weights = job.spec.rollout.weights_uri
    if weights is not None and not weights.startswith("s3://"):
        problems.append(WEIGHTS_URI_MESSAGE)
    return problems


def _describe(node: dict[str, Any], description: str | None) -> None:
    text = description or node.get("description")
    if text:
        node["description"] = " ".join(text.split())


def _with_default(description: str | None, default: Any) -> str | None:
    """Scalar defaults go into the description (kubectl explain shows them); the API server
    does not apply them: the operator and `rlft train` apply the pydantic defaults."""
    if isinstance(default, bool):
        shown = str(default).lower()
    elif isinstance(default, int | float) or (isinstance(default, str) and default):
        shown = str(default)
    else:
        return description
    text = " ".join((description or "").split())
    return f"{text} Default: {shown}." if text else f"Default: {shown}."


class _Converter:
    """Inline `$ref`s and rewrite JSON-schema constructs into their structural equivalents."""

    def __init__(self, defs: dict[str, Any], models: dict[str, type[BaseModel]]):
        self.defs = defs
        self.models = models

    def convert(self, schema: dict[str, Any]) -> dict[str, Any]:
        description = schema.get("description")
        default = schema.get("default")
        if "default" in schema:
            description = _with_default(description, default)
        node = self._convert_type(schema)
        _describe(node, description)
        return node

    def _convert_type(self, schema: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            node = self._convert_type(self.defs[name])
            _describe(node, self.defs[name].get("description"))
            if name in CEL_RULES:
                node["x-kubernetes-validations"] = CEL_RULES[name](self.models[name])
            return node
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._union(schema[key])
        if "allOf" in schema and len(schema["allOf"]) == 1:
            return self._convert_type(schema["allOf"][0])
        if "const" in schema:
            value = schema["const"]
            return {"type": _json_type(value), "enum": [value]}
        kind = schema.get("type")
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            node: dict[str, Any] = {"type": "array", "items": self.convert(schema.get("items", {}))}
            self._keep(schema, node)
            return node
        if kind in ("string", "integer", "number", "boolean"):
            node = {"type": kind}
            self._keep(schema, node)
            if schema.get("format") in _KNOWN_FORMATS:
                node["format"] = schema["format"]
            return node
        if "enum" in schema:
            return {"type": _json_type(schema["enum"][0]), "enum": list(schema["enum"])}
        # Any: accept whatever JSON comes (kept, not pruned).
        return {"x-kubernetes-preserve-unknown-fields": True}

    def _keep(self, schema: dict[str, Any], node: dict[str, Any]) -> None:
        for key in _KEPT_KEYWORDS:
            if key in schema:
                node[key] = schema[key]
        # JSON schema 2020-12 (pydantic) says exclusiveMinimum: X; OpenAPI v3.0 says
        # minimum: X, exclusiveMinimum: true.
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if exclusive in schema and not isinstance(schema[exclusive], bool):
                node[bound] = schema[exclusive]
                node[exclusive] = True

    def _object(self, schema: dict[str, Any]) -> dict[str, Any]:
        node: dict[str, Any] = {"type": "object"}
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if properties:
            node["properties"] = {k: self.convert(v) for k, v in properties.items()}
            if schema.get("required"):
                node["required"] = list(schema["required"])
        elif isinstance(extra, dict):
            node["additionalProperties"] = self.convert(extra)
            self._keep(schema, node)  # a map's bounds (maxProperties)
        else:
            node["x-kubernetes-preserve-unknown-fields"] = True
        return node

    def _union(self, members: list[dict[str, Any]]) -> dict[str, Any]:
        nullable = any(m.get("type") == "null" for m in members)
        rest = [m for m in members if m.get("type") != "null"]
        types = {m.get("type") for m in rest}
        if len(rest) == 1:
            node = self._convert_type(rest[0])
        elif types == {"string", "integer"}:
            node = {"x-kubernetes-int-or-string": True}
        elif types == {"integer", "number"}:
            node = {"type": "number"}
        else:
            # A union the API server cannot express structurally: pydantic checks it.
            node = {"x-kubernetes-preserve-unknown-fields": True}
            if types == {"object"} or all("$ref" in m for m in rest):
                node["type"] = "object"
        if nullable:
            node["nullable"] = True
        return node


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string"


def _all_models(model: type[BaseModel], found: dict[str, type[BaseModel]]) -> None:
    """Every pydantic model reachable from `model`, by its JSON-schema name."""
    found[model.__name__] = model
    for field in model.model_fields.values():
        for arg in _type_args(field.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg.__name__ not in found:
                _all_models(arg, found)


def _type_args(annotation: Any) -> list[Any]:
    out = [annotation]
    for arg in getattr(annotation, "__args__", ()) or ():
        out.extend(_type_args(arg))
    return out


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model (camelCase keys)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    models: dict[str, type[BaseModel]] = {}
    _all_models(model, models)
    converter = _Converter(defs, models)
    node = converter.convert(raw)
    if model.__name__ in CEL_RULES:
        node["x-kubernetes-validations"] = CEL_RULES[model.__name__](model)
    return node


def printer_columns() -> list[dict[str, Any]]:
    return [
        {
            "name": "Phase",
            "type": "string",
            "jsonPath": ".status.phase",
            "description": "Where the job is in its life cycle.",
        },
        {
            "name": "Step",
            "type": "integer",
            "jsonPath": ".status.step",
            "description": "Optimizer steps done (from the trainer's /status).",
        },
        {
            "name": "Reward",
            "type": "number",
            "jsonPath": ".status.reward",
            "description": "Mean reward of the latest step.",
        },
        {
            "name": "LastCheckpoint",
            "type": "integer",
            "jsonPath": ".status.lastCheckpoint.step",
            "description": "Step of the newest committed checkpoint.",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def build_crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition as a plain document."""
    spec = structural_schema(RLFineTuneSpec)
    status = structural_schema(RLFineTuneStatus)
    root = {
        "type": "object",
        "description": " ".join((RLFineTune.__doc__ or "").split()),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "Always `rlft.dev/v1alpha1`."},
            "kind": {"type": "string", "description": "Always `RLFineTune`."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [*transition_rules(), *_kubernetes_rules()],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "rlft"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "categories": ["rlft"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns(),
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


HEADER = (
    "# Generated by `{cmd}` from the pydantic models in trainer/config/ and\n"
    "# operator/status.py. Do not edit by hand: change the models and regenerate.\n"
)


def render_crd() -> str:
    """The CRD as YAML text, byte-for-byte deterministic."""
    body = yaml.safe_dump(
        copy.deepcopy(build_crd()), sort_keys=False, allow_unicode=True, width=100
    )
    return HEADER.format(cmd=REGENERATE) + body


def crd_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of the (generated or given) CRD."""
    crd = crd or build_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def write_crd(path: Path = CRD_PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_crd())
    return path
