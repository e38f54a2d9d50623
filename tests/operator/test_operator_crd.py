"""The generated CRD: fresh, structural, documented, and its CEL rules agree with pydantic."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from crd_validation import validate
from hypothesis import given
from hypothesis import strategies as st
from jobs import on_cluster
from pydantic import BaseModel, ValidationError

from rlft.operator import crd
from rlft.operator.status import RLFineTuneStatus
from rlft.trainer.config import (
    DataSpec,
    ModelSpec,
    PodCustomisation,
    Replicas,
    RLFineTuneSpec,
    RolloutSpec,
    read_yaml,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = crd.crd_schema()


def test_crd_file_is_fresh():
    on_disk = crd.CRD_PATH.read_text() if crd.CRD_PATH.exists() else ""
    assert on_disk == crd.render_crd(), (
        f"{crd.CRD_PATH.relative_to(ROOT)} is stale (the pydantic models changed): "
        f"run `.venv/bin/{crd.REGENERATE}` and commit the result"
    )


def test_rendering_is_deterministic():
    """The same CRD from processes whose string hashing differs (set and dict orders
    that leak into the output would show here)."""
    import subprocess
    import sys

    def rendered(seed: str) -> str:
        code = "from rlft.operator import crd; print(crd.render_crd(), end='')"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert rendered("1") == rendered("2") == crd.render_crd()


def test_cli_writes_the_same_file(tmp_path):
    out = tmp_path / "crd.yaml"
    cli = [sys.executable, "-m", "rlft.trainer.cli.main", "crd", "--out", str(out)]
    subprocess.run(cli, check=True, capture_output=True)
    assert out.read_text() == crd.render_crd()


def _walk(node, path="<root>"):
    yield path, node
    for key, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    for path, node in _walk(SCHEMA):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "not", "$defs", "title", "default"):
            assert banned not in node, f"{path} has {banned}"
        typed = "type" in node
        special = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        assert typed or special, f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if node.get("exclusiveMinimum") is not None:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_every_field_is_described():
    missing = [
        path
        for path, node in _walk(SCHEMA)
        if path not in ("<root>", "<root>.metadata")
        and not path.endswith(("[]", ".*"))  # list items and map values: described by their field
        and not node.get("description")
    ]
    assert missing == []


def _field_docs(model: type[BaseModel], prefix: str, out: dict[str, str]) -> None:
    for name, info in model.model_fields.items():
        alias = info.alias or name
        if info.description:
            out[f"{prefix}.{alias}"] = " ".join(info.description.split())
        annotation = info.annotation
        suffix = {list: "[]", dict: ".*"}.get(typing.get_origin(annotation), "")
        for arg in [annotation, *typing.get_args(annotation)]:
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                _field_docs(arg, f"{prefix}.{alias}{suffix}", out)


@pytest.mark.parametrize(("model", "key"), [(RLFineTuneSpec, "spec"), (RLFineTuneStatus, "status")])
def test_docstrings_become_descriptions(model, key):
    docs: dict[str, str] = {}
    _field_docs(model, f"<root>.{key}", docs)
    nodes = dict(_walk(SCHEMA))
    assert len(docs) > 20
    for path, doc in docs.items():
        assert path in nodes, f"{path} is missing from the schema"
        assert nodes[path]["description"].startswith(doc), path


def test_crd_shape():
    doc = crd.build_crd()
    version = doc["spec"]["versions"][0]
    assert doc["metadata"]["name"] == "rlfinetunes.rlft.dev"
    assert doc["spec"]["names"]["shortNames"] == ["rlft"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Step", "Reward", "LastCheckpoint", "Age"]
    nodes = dict(_walk(SCHEMA))
    for column in version["additionalPrinterColumns"][:-1]:  # Age reads metadata
        assert "<root>" + column["jsonPath"] in nodes, column


def test_cel_rules_name_existing_models():
    raw = RLFineTuneSpec.model_json_schema(by_alias=True)
    for name in crd.CEL_RULES:
        assert name in raw["$defs"], f"CEL rules for {name}, which the job models no longer have"


def test_crd_files_pass_kubernetes_validate():
    files = [str(crd.CRD_PATH), str(ROOT / "crds" / "kopf-peering.yaml")]
    result = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", *files],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 3


# ------------------------------------------------------- CEL rules versus pydantic


def _node(path: list[str]) -> dict:
    node = SCHEMA
    for part in path:
        node = node["properties"][part]
    return node


def _cel_ok(path: list[str], value: dict) -> bool:
    problems = [
        p
        for p in validate({"spec": value}, {"type": "object", "properties": {"spec": _node(path)}})[
            1
        ]
    ]
    return not problems


def _pydantic_ok(model: type[BaseModel], value: dict) -> bool:
    try:
        model.model_validate(value, by_alias=True, by_name=False)
    except ValidationError:
        return False
    return True


@given(st.integers(1, 4096), st.integers(1, 4096), st.booleans(), st.booleans())
def test_replicas_rule_agrees_with_pydantic(lo, hi, with_lo, with_hi):
    value = {**({"min": lo} if with_lo else {}), **({"max": hi} if with_hi else {})}
    path = ["spec", "trainer", "replicas"]
    assert _cel_ok(path, value) == _pydantic_ok(Replicas, value)


@given(st.integers(0, 512), st.integers(1, 16), st.integers(1, 16))
def test_rollout_rule_agrees_with_pydantic(gpus, tp, ep):
    value = {"gpusPerInstance": gpus, "tensorParallel": tp, "expertParallel": ep}
    assert _cel_ok(["spec", "rollout"], value) == _pydantic_ok(RolloutSpec, value)


@given(st.booleans(), st.booleans())
def test_model_rule_agrees_with_pydantic(path, init):
    value = {**({"path": "/models/x"} if path else {}), **({"init": {}} if init else {})}
    assert _cel_ok(["spec", "model"], value) == _pydantic_ok(ModelSpec, value)


@given(st.sampled_from(["arithmetic", "jsonl"]), st.booleans())
def test_data_rule_agrees_with_pydantic(source, jsonl):
    value = {"source": source, **({"jsonl": {"train": "a.jsonl"}} if jsonl else {})}
    assert _cel_ok(["spec", "data"], value) == _pydantic_ok(DataSpec, value)


# ------------------------------------------------------- whole manifests


def _local_example() -> dict:
    return read_yaml((ROOT / "examples" / "tiny-grpo.yaml").read_text())


def _example() -> dict:
    return on_cluster(_local_example())


def test_example_is_valid():
    _, problems, _ = validate(_example(), SCHEMA)
    assert problems == []


@pytest.mark.parametrize("uri", [None, "file:///shared/ckpt", "/data/ckpt"])
def test_a_job_whose_pods_cannot_share_a_location_is_refused_naming_the_field(uri):
    doc = _local_example()
    if uri is not None:
        doc["spec"]["checkpoint"] = {"uri": uri}
    _, problems, _ = validate(doc, SCHEMA)
    assert [p.field for p in problems] == ["spec.checkpoint.uri"], problems
    assert "s3://" in problems[0].message
    weights = _example()
    weights["spec"]["rollout"]["weightsUri"] = "file:///shared/weights"
    _, problems, _ = validate(weights, SCHEMA)
    assert [p.field for p in problems] == ["spec.rollout.weightsUri"], problems


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        ({"trainer": {"microBatchSize": 0}}, "spec.trainer.microBatchSize", "less than"),
        ({"trainer": {"replicas": {"min": 3, "max": 2}}}, "spec.trainer.replicas.min", "min must"),
        ({"rollout": {"temperture": 1.0}}, "spec.rollout.temperture", "unknown field"),
        (
            {"rollout": {"gpusPerInstance": 3, "tensorParallel": 2}},
            "spec.rollout.gpusPerInstance",
            "divisible",
        ),
        ({"checkpoint": {"keepLast": "3"}}, "spec.checkpoint.keepLast", "is not of type"),
        ({"restartPolicy": {"backoffSeconds": -1}}, "spec.restartPolicy.backoffSeconds", "less"),
    ],
)
def test_invalid_manifests_name_the_field(patch, field, words):
    doc = _example()
    for section, values in patch.items():
        target = doc["spec"].setdefault(section, {})
        for key, value in values.items():
            target[key] = value
    _, problems, _ = validate(doc, SCHEMA)
    assert any(p.field == field and words in p.message for p in problems), problems


def _running(doc: dict) -> dict:
    return {**doc, "status": {"phase": "Running"}}


def test_identity_fields_are_immutable_once_started():
    """The whole table of what may change when: test_operator_spec_changes.py."""
    old = _running(_example())
    new = yaml.safe_load(yaml.safe_dump(old))
    new["spec"]["model"]["init"]["hiddenSize"] = 256
    _, problems, _ = validate(new, SCHEMA, old)
    assert [p.field for p in problems] == ["spec.model"], problems
    assert "cannot change once the job has started" in problems[0].message
    # suspending, or changing what may change, is fine
    new = yaml.safe_load(yaml.safe_dump(old))
    new["spec"]["suspend"] = True
    new["spec"].setdefault("restartPolicy", {})["maxRestarts"] = 3
    assert validate(new, SCHEMA, old)[1] == []
    # suspended, the model still may not change; before it started, it may
    old["spec"]["suspend"], old["status"]["phase"] = True, "Suspended"
    new["spec"]["model"]["init"]["hiddenSize"] = 256
    assert [p.field for p in validate(new, SCHEMA, old)[1]] == ["spec.model"]
    del old["status"]
    assert validate(new, SCHEMA, old)[1] == []


def test_rules_on_values_an_update_leaves_unchanged_are_ratcheted():
    """As kube-apiserver (≥ 1.30) does: a status write does not re-check rules on a
    spec it left as it was (an object stored before a rule tightened stays writable),
    while the same value written as a change is checked."""
    stored = _running(_example())
    stored["spec"]["trainer"]["replicas"] = {"min": 3, "max": 2}  # breaks a CEL rule
    status_write = yaml.safe_load(yaml.safe_dump(stored))
    status_write["status"]["step"] = 7
    assert validate(status_write, SCHEMA, stored)[1] == []
    before = yaml.safe_load(yaml.safe_dump(stored))
    before["spec"]["trainer"]["replicas"] = {"min": 1, "max": 2}
    problems = validate(status_write, SCHEMA, before)[1]
    assert [p.field for p in problems] == ["spec.trainer.replicas.min"], problems


# ------------------------------------------------------- a role's own pod settings

_SOURCES = {
    "persistentVolumeClaim": {"claimName": "weights"},
    "configMap": {"name": "templates"},
    "secret": {"secretName": "token"},
    "emptyDir": {},
}


@given(st.lists(st.sampled_from(sorted(_SOURCES)), unique=True))
def test_volume_source_rule_agrees_with_pydantic(sources):
    value = {"volumes": [{"name": "v", **{s: _SOURCES[s] for s in sources}}]}
    path = ["spec", "trainer", "pod"]
    assert _cel_ok(path, value) == _pydantic_ok(PodCustomisation, value)


@given(st.booleans(), st.booleans())
def test_env_from_rule_agrees_with_pydantic(config_map, secret):
    entry = {
        **({"configMapRef": {"name": "c"}} if config_map else {}),
        **({"secretRef": {"name": "s"}} if secret else {}),
    }
    value = {"envFrom": [entry]}
    assert _cel_ok(["spec", "rollout", "pod"], value) == _pydantic_ok(PodCustomisation, value)


@given(
    st.sets(st.sampled_from(["a", "b", "c"])),
    st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=4),
    st.booleans(),
)
def test_mounts_name_declared_volumes_like_pydantic(volumes, mounts, with_volumes):
    value: dict = {
        "volumeMounts": [{"name": n, "mountPath": f"/m{i}"} for i, n in enumerate(mounts)]
    }
    if with_volumes:
        value["volumes"] = [{"name": n, "emptyDir": {}} for n in sorted(volumes)]
    assert _cel_ok(["spec", "trainer", "pod"], value) == _pydantic_ok(PodCustomisation, value)


def test_a_job_with_every_pod_setting_is_valid():
    from pod_jobs import every_pod_setting

    _, problems, warnings = validate(every_pod_setting(), SCHEMA)
    assert problems == [] and warnings == []


@pytest.mark.parametrize(
    ("pod", "field", "words"),
    [
        (
            {"volumes": [{"name": "v", "emptyDir": {}, "secret": {"secretName": "s"}}]},
            "spec.trainer.pod.volumes[0]",
            "exactly one source",
        ),
        (
            {"volumes": [{"name": "v", "hostPath": {"path": "/"}}]},
            "spec.trainer.pod.volumes[0].hostPath",
            "unknown field",
        ),
        (
            {"volumeMounts": [{"name": "v", "mountPath": "/v"}]},
            "spec.trainer.pod.volumeMounts",
            "must name one of volumes",
        ),
        (
            {
                "volumes": [{"name": "v", "emptyDir": {}}],
                "volumeMounts": [{"name": "v", "mountPath": "v"}],
            },
            "spec.trainer.pod.volumeMounts[0].mountPath",
            "does not match",
        ),
        ({"capabilities": ["SYS_ADMIN"]}, "spec.trainer.pod.capabilities[0]", "is not one of"),
        ({"envFrom": [{"prefix": "X_"}]}, "spec.trainer.pod.envFrom[0]", "exactly one of"),
        ({"serviceAccountName": "S3"}, "spec.trainer.pod.serviceAccountName", "does not match"),
        ({"labels": {f"k{i}": "v" for i in range(65)}}, "spec.trainer.pod.labels", "too many"),
    ],
)
def test_the_crd_refuses_bad_pod_settings_naming_the_field(pod, field, words):
    doc = _example()
    doc["spec"]["trainer"]["pod"] = pod
    _, problems, _ = validate(doc, SCHEMA)
    assert any(p.field == field and words in p.message for p in problems), problems
