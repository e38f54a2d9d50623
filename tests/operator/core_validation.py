"""Validation of built-in objects the way kube-apiserver validates them, for the emulated
API server (kube_emulator.py calls `problems` on every create and update of a Pod,
Service, ConfigMap or Secret, and `pod_update_problems` on every update of a Pod).

A subset of k8s.io/kubernetes pkg/apis/core/validation (v1.30): the parts that the
objects the operator creates, with a job's own settings in them, can get wrong:

- object names (a Service's a DNS-1035 label; a Pod's, ConfigMap's, Secret's a DNS-1123
  subdomain), label keys and values;
- pods: containers (names, image, ports: IANA_SVC_NAME names unique in the pod, numbers
  1–65535), `env` (`valueFrom` with exactly one source, `fieldRef` paths among those
  the downward API serves as variables, key selectors with a name and a key), `envFrom`,
  volumes (DNS-1123 label names, unique, one source each) and their mounts (a volume of
  the pod, a path unique in the container, a subPath that stays inside the volume),
  probes (liveness and startup `successThreshold` must be 1, one handler, nonnegative
  numbers), `restartPolicy`, `hostname` and `subdomain` (DNS-1123 labels), requests at
  most their limits and extended resources' requests equal to them;
- Services: ports (a name each when there are several, unique; numbers 1–65535);
- ConfigMaps and Secrets: keys, and at most 1 MiB of data together;
- pod updates: the spec is immutable but for the fields ValidatePodUpdate lets change
  (images, activeDeadlineSeconds, added tolerations, terminationGracePeriodSeconds) and
  the binding of `nodeName` (which a real scheduler posts to pods/binding; the test
  cluster's scheduler patches it).

Messages read like kube-apiserver's field errors: `spec.volumes[4].name: Duplicate value:
"tmp"`.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from typing import Any

from crd_validation import Problem

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
    "'-' or '.', and must start and end with an alphanumeric character (e.g. "
    "'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
DNS1035_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start "
    "with an alphabetic character, and end with an alphanumeric character (e.g. "
    "'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
ENV_FIELD_PATHS = (
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
)
"""validEnvDownwardAPIFieldPathExpressions (besides metadata.labels['…'] and
metadata.annotations['…'])."""
VOLUME_SOURCES = (
    "configMap", "secret", "emptyDir", "hostPath", "persistentVolumeClaim", "projected",
    "downwardAPI", "ephemeral", "nfs", "csi", "image",
)  # fmt: skip
CONFIG_MAP_MAX_BYTES = 1024 * 1024
"""MaxSecretSize, and the same limit on a ConfigMap's data and binaryData together."""
POD_UPDATABLE = (
    "spec: Forbidden: pod updates may not change fields other than "
    "`spec.containers[*].image`,`spec.initContainers[*].image`,"
    "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing "
    "tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
    "previously negative)"
)


def _q(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def invalid(path: str, value: Any, why: str) -> Problem:
    return Problem(path, f"Invalid value: {_q(value)}: {why}", "FieldValueInvalid")


def duplicate(path: str, value: Any) -> Problem:
    return Problem(path, f"Duplicate value: {_q(value)}", "FieldValueDuplicate")


def not_found(path: str, value: Any) -> Problem:
    return Problem(path, f"Not found: {_q(value)}", "FieldValueNotFound")


def required(path: str, why: str = "") -> Problem:
    return Problem(path, "Required value" + (f": {why}" if why else ""), "FieldValueRequired")


def unsupported(path: str, value: Any, supported: tuple[str, ...]) -> Problem:
    listed = ", ".join(json.dumps(s) for s in sorted(supported))
    return Problem(
        path,
        f"Unsupported value: {_q(value)}: supported values: {listed}",
        "FieldValueNotSupported",
    )


def _dns_name(
    path: str, value: Any, longest: int, pattern: re.Pattern, message: str
) -> list[Problem]:
    if not isinstance(value, str) or not value:
        return [required(path)]
    out = []
    if len(value) > longest:
        out.append(invalid(path, value, f"must be no more than {longest} characters"))
    if not pattern.match(value):
        out.append(invalid(path, value, message))
    return out


def _dns_label(path: str, value: Any) -> list[Problem]:
    return _dns_name(path, value, 63, DNS1123_LABEL, LABEL_MSG)


def _unique_label(path: str, name: str, names: set[str]) -> list[Problem]:
    """A DNS label not among `names` (which it joins)."""
    out = _dns_label(path, name)
    if name in names:
        out.append(duplicate(path, name))
    names.add(name)
    return out


def _subdomain(path: str, value: Any) -> list[Problem]:
    return _dns_name(path, value, 253, DNS1123_SUBDOMAIN, SUBDOMAIN_MSG)


def _qualified_name(path: str, key: str) -> list[Problem]:
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return [invalid(path, key, "prefix part " + SUBDOMAIN_MSG)]
    if not name or len(name) > 63 or not QUALIFIED_NAME.match(name):
        return [
            invalid(
                path,
                key,
                "name part must consist of alphanumeric characters, '-', '_' or '.', and "
                "must start and end with an alphanumeric character, at most 63 characters",
            )
        ]
    return []


def _metadata(kind: str, meta: dict[str, Any]) -> list[Problem]:
    name = meta.get("name", "")
    out: list[Problem] = []
    if kind == "Service":
        if len(name) > 63:
            out.append(invalid("metadata.name", name, "must be no more than 63 characters"))
        if not DNS1035_LABEL.match(name):
            out.append(invalid("metadata.name", name, DNS1035_MSG))
    else:
        out += _subdomain("metadata.name", name)
    for key, value in (meta.get("labels") or {}).items():
        out += _qualified_name("metadata.labels", key)
        value = "" if value is None else str(value)
        if len(value) > 63:
            out.append(invalid("metadata.labels", value, "must be no more than 63 characters"))
        elif value and not QUALIFIED_NAME.match(value):
            out.append(
                invalid(
                    "metadata.labels",
                    value,
                    "a valid label must be an empty string or consist of alphanumeric "
                    "characters, '-', '_' or '.', and must start and end with an "
                    "alphanumeric character",
                )
            )
    for key in meta.get("annotations") or {}:
        out += _qualified_name("metadata.annotations", key.lower())
    return out


# ---------------------------------------------------------------------- quantities
_SUFFIX = {
    **{s: Fraction(1024**i) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)},
    **{s: Fraction(1000**i) for i, s in enumerate(("k", "M", "G", "T", "P", "E"), 1)},
    "m": Fraction(1, 1000),
    "u": Fraction(1, 10**6),
    "n": Fraction(1, 10**9),
    "": Fraction(1),
}


def quantity(value: Any) -> Fraction | None:
    """A resource.Quantity's value, None when it does not parse."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return Fraction(value)
    text = str(value)
    m = re.match(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(.*)$", text)
    if not m:
        return None
    number, suffix = Fraction(m.group(1)), m.group(2)
    if suffix in _SUFFIX:
        return number * _SUFFIX[suffix]
    if re.match(r"^[eE][+-]?[0-9]+$", suffix):
        return number * Fraction(10) ** int(suffix[1:])
    return None


def _overcommittable(resource: str) -> bool:
    """helper.IsOverCommitAllowed: native resources (no domain, or kubernetes.io/) but
    hugepages; extended resources such as nvidia.com/gpu are not."""
    native = "/" not in resource or "kubernetes.io/" in resource
    return native and not resource.startswith("hugepages-")


def _resources(path: str, resources: dict[str, Any]) -> list[Problem]:
    out: list[Problem] = []
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    for kind, values in (("limits", limits), ("requests", requests)):
        for name, value in values.items():
            amount = quantity(value)
            where = f"{path}.{kind}[{name}]"
            if amount is None:
                out.append(
                    invalid(where, value, "quantities must match the regular expression "
                            "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
                )  # fmt: skip
            elif amount < 0:
                out.append(invalid(where, value, "must be greater than or equal to 0"))
    for name, value in requests.items():
        asked, limit = quantity(value), quantity(limits.get(name)) if name in limits else None
        if asked is None:
            continue
        if not _overcommittable(name):
            if name not in limits:
                out.append(
                    required(f"{path}.limits", "Limit must be set for non overcommitable resources")
                )
            elif limit is not None and asked != limit:
                out.append(
                    invalid(
                        f"{path}.requests[{name}]",
                        str(value),
                        f"must be equal to {name} limit of {limits[name]}",
                    )
                )
        elif limit is not None and asked > limit:
            out.append(
                invalid(
                    f"{path}.requests[{name}]",
                    str(value),
                    f"must be less than or equal to {name} limit of {limits[name]}",
                )
            )
    return out


# ---------------------------------------------------------------------- pods
def _env(path: str, env: list[dict[str, Any]]) -> list[Problem]:
    out: list[Problem] = []
    for i, item in enumerate(env):
        where = f"{path}[{i}]"
        if not item.get("name"):
            out.append(required(f"{where}.name"))
        source = item.get("valueFrom")
        if source is None:
            continue
        vf = f"{where}.valueFrom"
        sources = [k for k in ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")
                   if source.get(k) is not None]  # fmt: skip
        if not sources:
            out.append(
                invalid(
                    vf,
                    "",
                    "must specify one of: `fieldRef`, `resourceFieldRef`, `configMapKeyRef` "
                    "or `secretKeyRef`",
                )
            )
        elif item.get("value"):
            out.append(invalid(vf, "", "may not be specified when `value` is not empty"))
        elif len(sources) > 1:
            out.append(invalid(vf, "", "may not have more than one field specified at a time"))
        if source.get("fieldRef") is not None:
            field_path = source["fieldRef"].get("fieldPath") or ""
            fr = f"{vf}.fieldRef"
            m = re.match(r"^(.*)\['(.*)'\]$", field_path)
            if not field_path:
                out.append(required(f"{fr}.fieldPath"))
            elif m and m.group(1) in ("metadata.labels", "metadata.annotations"):
                out += [Problem(fr, p.message, p.reason) for p in _qualified_name(fr, m.group(2))]
            elif m:
                out.append(invalid(fr, m.group(1), "does not support subscript"))
            elif field_path not in ENV_FIELD_PATHS:
                out.append(unsupported(f"{fr}.fieldPath", field_path, ENV_FIELD_PATHS))
        for key in ("configMapKeyRef", "secretKeyRef"):
            ref = source.get(key)
            if ref is None:
                continue
            if not ref.get("key"):
                out.append(required(f"{vf}.{key}.key"))
            elif not CONFIG_KEY.match(ref["key"]):
                out.append(
                    invalid(f"{vf}.{key}.key", ref["key"], "a valid config key must consist "
                            "of alphanumeric characters, '-', '_' or '.'")
                )  # fmt: skip
            if ref.get("name"):
                out += _subdomain(f"{vf}.{key}.name", ref["name"])
    return out


def _env_from(path: str, items: list[dict[str, Any]]) -> list[Problem]:
    out: list[Problem] = []
    for i, item in enumerate(items):
        refs = [k for k in ("configMapRef", "secretRef") if item.get(k) is not None]
        if not refs:
            out.append(invalid(path, "", "must specify one of: `configMapRef` or `secretRef`"))
        elif len(refs) > 1:
            out.append(invalid(path, "", "may not have more than one field specified at a time"))
        for key in refs:
            name = item[key].get("name")
            if not name:
                out.append(required(f"{path}[{i}].{key}.name"))
            else:
                out += _subdomain(f"{path}[{i}].{key}.name", name)
    return out


def _probe(path: str, probe: dict[str, Any] | None, kind: str) -> list[Problem]:
    if probe is None:
        return []
    out: list[Problem] = []
    handlers = [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if probe.get(h) is not None]
    if not handlers:
        out.append(required(path, "must specify a handler type"))
    elif len(handlers) > 1:
        out.append(
            Problem(
                path, "Forbidden: may not specify more than 1 handler type", "FieldValueForbidden"
            )
        )
    for key in ("initialDelaySeconds", "timeoutSeconds", "periodSeconds", "successThreshold",
                "failureThreshold"):  # fmt: skip
        if probe.get(key, 0) < 0:
            out.append(invalid(f"{path}.{key}", probe[key], "must be greater than or equal to 0"))
    if kind in ("livenessProbe", "startupProbe") and probe.get("successThreshold", 1) != 1:
        out.append(invalid(f"{path}.successThreshold", probe["successThreshold"], "must be 1"))
    grace = probe.get("terminationGracePeriodSeconds")
    if grace is not None and grace <= 0:
        out.append(
            invalid(f"{path}.terminationGracePeriodSeconds", grace, "must be greater than 0")
        )
    return out


def _port_name(path: str, name: str) -> list[Problem]:
    """validation.IsValidPortName (IANA_SVC_NAME)."""
    why = None
    if len(name) > 15:
        why = "must be no more than 15 characters"
    elif not re.match(r"^[-a-z0-9]+$", name):
        why = "must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)"
    elif not re.search(r"[a-z]", name):
        why = "must contain at least one letter (a-z)"
    elif "--" in name:
        why = "must not contain consecutive hyphens"
    elif name.startswith("-") or name.endswith("-"):
        why = "must not begin or end with a hyphen"
    return [invalid(path, name, why)] if why else []


def _port_number(path: str, number: Any) -> list[Problem]:
    if not isinstance(number, int) or not 1 <= number <= 65535:
        return [invalid(path, number, "must be between 1 and 65535, inclusive")]
    return []


def _volumes(spec: dict[str, Any]) -> tuple[list[Problem], set[str]]:
    out: list[Problem] = []
    names: set[str] = set()
    for i, volume in enumerate(spec.get("volumes") or []):
        where = f"spec.volumes[{i}]"
        out += _unique_label(f"{where}.name", volume.get("name", ""), names)
        sources = [k for k in volume if k != "name"]
        if not sources:
            out.append(required(where, "must specify a volume type"))
        elif len(sources) > 1:
            out.append(
                Problem(
                    f"{where}.{sources[1]}",
                    "Forbidden: may not specify more than 1 volume type",
                    "FieldValueForbidden",
                )
            )
    return out, names


def _mounts(path: str, mounts: list[dict[str, Any]], volumes: set[str]) -> list[Problem]:
    out: list[Problem] = []
    paths: set[str] = set()
    for i, mount in enumerate(mounts):
        where = f"{path}[{i}]"
        if not mount.get("name"):
            out.append(required(f"{where}.name"))
        if mount.get("name") not in volumes:
            out.append(not_found(f"{where}.name", mount.get("name", "")))
        target = mount.get("mountPath", "")
        if not target:
            out.append(required(f"{where}.mountPath"))
        if target in paths:
            out.append(invalid(f"{where}.mountPath", target, "must be unique"))
        paths.add(target)
        sub = mount.get("subPath") or ""
        if sub.startswith("/"):
            out.append(invalid(f"{path}.subPath", sub, "must be a relative path"))
        if ".." in sub.split("/"):
            out.append(invalid(f"{path}.subPath", sub, "must not contain '..'"))
    return out


def pod_problems(pod: dict[str, Any]) -> list[Problem]:
    spec = pod.get("spec") or {}
    out, volumes = _volumes(spec)
    containers = spec.get("containers") or []
    if not containers:
        out.append(required("spec.containers"))
    names: set[str] = set()
    port_names: set[str] = set()
    for i, container in enumerate(containers):
        where = f"spec.containers[{i}]"
        out += _unique_label(f"{where}.name", container.get("name", ""), names)
        if not container.get("image"):
            out.append(required(f"{where}.image"))
        for j, port in enumerate(container.get("ports") or []):
            pw = f"{where}.ports[{j}]"
            if port.get("name"):
                out += _port_name(f"{pw}.name", port["name"])
                if port["name"] in port_names:
                    out.append(duplicate(f"{pw}.name", port["name"]))
                port_names.add(port["name"])
            out += _port_number(f"{pw}.containerPort", port.get("containerPort"))
            if port.get("protocol", "TCP") not in ("TCP", "UDP", "SCTP"):
                out.append(unsupported(f"{pw}.protocol", port["protocol"], ("SCTP", "TCP", "UDP")))
        out += _env(f"{where}.env", container.get("env") or [])
        out += _env_from(f"{where}.envFrom", container.get("envFrom") or [])
        out += _mounts(f"{where}.volumeMounts", container.get("volumeMounts") or [], volumes)
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            out += _probe(f"{where}.{kind}", container.get(kind), kind)
        out += _resources(f"{where}.resources", container.get("resources") or {})
        policy = container.get("terminationMessagePolicy", "File")
        if policy not in ("File", "FallbackToLogsOnError"):
            out.append(
                unsupported(
                    f"{where}.terminationMessagePolicy", policy, ("FallbackToLogsOnError", "File")
                )
            )
    restart = spec.get("restartPolicy", "Always")
    if restart not in ("Always", "OnFailure", "Never"):
        out.append(unsupported("spec.restartPolicy", restart, ("Always", "Never", "OnFailure")))
    for key in ("hostname", "subdomain"):
        if spec.get(key):
            out += _dns_label(f"spec.{key}", spec[key])
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and grace < 0:
        out.append(
            invalid(
                "spec.terminationGracePeriodSeconds", grace, "must be greater than or equal to 0"
            )
        )
    return out


def _service_problems(svc: dict[str, Any]) -> list[Problem]:
    spec = svc.get("spec") or {}
    ports = spec.get("ports") or []
    out: list[Problem] = []
    if not ports and spec.get("clusterIP") != "None" and spec.get("type") != "ExternalName":
        out.append(required("spec.ports"))
    names: set[str] = set()
    for i, port in enumerate(ports):
        where = f"spec.ports[{i}]"
        name = port.get("name", "")
        if len(ports) > 1 and not name:
            out.append(required(f"{where}.name"))
        elif name:
            out += _dns_label(f"{where}.name", name)
            if name in names:
                out.append(duplicate(f"{where}.name", name))
            names.add(name)
        out += _port_number(f"{where}.port", port.get("port"))
        target = port.get("targetPort")
        if isinstance(target, int):
            out += _port_number(f"{where}.targetPort", target)
        elif isinstance(target, str):
            out += _port_name(f"{where}.targetPort", target)
    return out


def _data_problems(obj: dict[str, Any], kind: str) -> list[Problem]:
    out: list[Problem] = []
    total = 0
    for field_ in ("data", "binaryData", "stringData"):
        for key, value in (obj.get(field_) or {}).items():
            if len(key) > 253 or not CONFIG_KEY.match(key):
                out.append(
                    invalid(f"{field_}[{key}]", key, "a valid config key must consist of "
                            "alphanumeric characters, '-', '_' or '.'")
                )  # fmt: skip
            # Secrets' data and ConfigMaps' binaryData are base64: their size is decoded.
            encoded = field_ == "binaryData" or (kind == "Secret" and field_ == "data")
            total += len(value) * 3 // 4 if encoded else len(str(value).encode())
    if total > CONFIG_MAP_MAX_BYTES:
        where = "data" if kind == "Secret" else ""
        out.append(
            Problem(
                where,
                f"Too long: must have at most {CONFIG_MAP_MAX_BYTES} bytes",
                "FieldValueTooLong",
            )
        )
    return out


def problems(kind: str, obj: dict[str, Any]) -> list[Problem]:
    """What kube-apiserver's validation refuses in a Pod, Service, ConfigMap or Secret."""
    out = _metadata(kind, obj.get("metadata") or {})
    if kind == "Pod":
        out += pod_problems(obj)
    elif kind == "Service":
        out += _service_problems(obj)
    elif kind in ("ConfigMap", "Secret"):
        out += _data_problems(obj, kind)
    return out


def _tolerations(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec.get("tolerations") or [])


def pod_update_problems(old: dict[str, Any], new: dict[str, Any]) -> list[Problem]:
    """ValidatePodUpdate's rule on the spec: only images, activeDeadlineSeconds, added
    tolerations and terminationGracePeriodSeconds change; nodeName only from unset (the
    binding)."""
    before, after = (
        json.loads(json.dumps(old.get("spec") or {})),
        json.loads(json.dumps(new.get("spec") or {})),
    )
    for spec in (before, after):
        for container in spec.get("containers") or []:
            container.pop("image", None)
        spec.pop("activeDeadlineSeconds", None)
        spec.pop("terminationGracePeriodSeconds", None)
    if not before.get("nodeName") and after.get("nodeName"):
        before["nodeName"] = after["nodeName"]
    kept = _tolerations(before)
    if all(t in _tolerations(after) for t in kept):
        before.pop("tolerations", None)
        after.pop("tolerations", None)
    if before != after:
        return [Problem("spec", POD_UPDATABLE.removeprefix("spec: "), "FieldValueForbidden")]
    return []
