"""An emulated Kubernetes API server for tests: kmock's KubernetesEmulator with the gaps
docs/build.md lists closed. Not a cluster: nothing schedules or runs pods; tests play the
kubelet by patching pod status with kubectl.

kmock brings the HTTP server on loopback, API discovery and error rendering; this subclass
serves the resource endpoints itself, with the semantics kopf and kubectl rely on:

- metadata stamped on create (uid, resourceVersion, creationTimestamp, generation,
  namespace; generateName), 201 Created, 409 AlreadyExists, 404 NotFound, as Status objects;
- one global resourceVersion, bumped on every write; `metadata.resourceVersion` in a patch
  or PUT is a precondition (409 Conflict), as are a DELETE's `preconditions` (uid,
  resourceVersion); no-op writes change nothing;
- merge patch, JSON patch (a failed `test` is 422), strategic merge treated as merge
  patch, PUT; the status subresource (the main endpoint ignores status, /status ignores the
  rest); generation bumps on spec changes;
- list and watch with labelSelector, fieldSelector (metadata.name/namespace), watch from a
  resourceVersion (410 Gone when too old), bookmarks, sendInitialEvents, timeoutSeconds;
  lists carry kind/apiVersion; watch streams are `application/json`;
- finalizers and deletionTimestamp; owner-reference garbage collection (background);
- a CRD becomes a served resource when created (discovery included), and its custom
  resources are validated like kube-apiserver does (schema, unknown fields per
  fieldValidation, CEL rules: see crd_validation.py); server-side printing (Table) with the
  CRD's printer columns, so `kubectl get` shows them;
- `v1/namespaces` in discovery, `groupVersion: v1` for the core group;
- the Eviction subresource of pods (what `kubectl drain` uses): the DisruptionTarget
  condition, then a graceful delete (no PodDisruptionBudget is checked);
- NamespaceLifecycle admission: a create in a namespace that does not exist is refused
  404, in one being deleted 403 (`terminate_namespace` marks one Terminating; removing
  its content is not emulated); the namespaces a cluster starts with (default,
  kube-system, kube-public, kube-node-lease);
- ServiceAccount admission: a pod's `serviceAccountName` defaults to `default`, and a pod
  naming an account that does not exist is refused 403; every namespace gets its
  `default` account when created (the service-account controller's part; no tokens);
- validation of Pods, Services, ConfigMaps and Secrets on create and update, as
  kube-apiserver's ValidatePod & co. (core_validation.py: 422 with the field errors; a
  pod's spec immutable but for images, tolerations added, grace and nodeName's binding);
- ResourceQuota admission of creates (quota.py): a create over a namespace's quota is
  refused 403 Forbidden with the real message (`pods "x" is forbidden: exceeded quota:
  …`), before the AlreadyExists check, as admission runs before storage.

Still missing: server-side apply, dry-run, /openapi (kubectl needs --validate=false),
admission webhooks, other admission plugins (PodSecurity, LimitRanger), the quota
controller's status.used, and anything a controller or kubelet would do.

Run: `python tests/operator/kube_emulator.py --port-file FILE` (prints nothing; writes
its port to FILE when it serves, stops on SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import copy
import json
import re
import signal
import sys
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import core_validation
import crd_validation
import quota

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
LOG_LIMIT = 200_000


def _now(later_s: float = 0) -> str:
    return (datetime.now(UTC) + timedelta(seconds=later_s)).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiStatus(Exception):
    """An error answered as a Kubernetes Status object."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def body(self) -> dict[str, Any]:
        out = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
        }
        if self.details:
            out["details"] = self.details
        return out


@dataclass
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: tuple[str, ...] = ()
    short_names: tuple[str, ...] = ()
    singular: str = ""
    schema: dict[str, Any] | None = None
    printer_columns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)


BUILTIN = [
    ResourceType("", "v1", "namespaces", "Namespace", False, ("status",)),
    ResourceType("", "v1", "pods", "Pod", True, ("status",), ("po",)),
    ResourceType("", "v1", "nodes", "Node", False, ("status",), ("no",)),
    ResourceType("", "v1", "services", "Service", True, ("status",), ("svc",)),
    ResourceType("", "v1", "configmaps", "ConfigMap", True, (), ("cm",)),
    ResourceType("", "v1", "secrets", "Secret", True),
    ResourceType("", "v1", "events", "Event", True, (), ("ev",)),
    ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, (), ("sa",)),
    ResourceType("", "v1", "resourcequotas", "ResourceQuota", True, ("status",), ("quota",)),
    ResourceType("", "v1", "persistentvolumes", "PersistentVolume", False, ("status",), ("pv",)),
    ResourceType(
        "", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True, ("status",), ("pvc",)
    ),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        ("status",),
        ("crd", "crds"),
    ),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
    ResourceType(
        "networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", True, (), ("netpol",)
    ),
]


@dataclass(frozen=True)
class Route:
    group: str
    version: str
    plural: str
    namespace: str | None
    name: str | None
    sub: str | None


def parse_route(path: str) -> Route | None:
    """A resource request's parts, or None for discovery and other paths."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest:
        return None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    elif rest[0] == "namespaces":
        return Route(group, version, "namespaces", None, rest[1] if len(rest) > 1 else None, None)
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    sub = "/".join(rest[2:]) or None
    return Route(group, version, plural, namespace, name, sub)


# ----------------------------------------------------------------------- selectors

_SET_EXPR = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current)
    return parts


def label_match(selector: str | None, labels: dict[str, str]) -> bool:
    if not selector:
        return True
    for term in _split_selector(selector):
        term = term.strip()
        if m := _SET_EXPR.match(term):
            values = {v.strip() for v in m.group(3).split(",")}
            present = m.group(1) in labels and labels[m.group(1)] in values
            if (m.group(2) == "in") != present:
                return False
        elif "!=" in term:
            key, value = (x.strip() for x in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (x.strip() for x in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_match(selector: str | None, obj: dict[str, Any]) -> bool:
    if not selector:
        return True
    for term in selector.split(","):
        negate = "!=" in term
        key, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        current: Any = obj
        for part in key.strip().split("."):
            current = current.get(part) if isinstance(current, dict) else None
        if (str(current) == value.strip()) == negate:
            return False
    return True


# ------------------------------------------------------------------------ patching


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiStatus(422, "Invalid", f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902: add, remove, replace, test, move, copy."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        if kind == "test":
            current: Any = doc
            try:
                for p in parts:
                    current = current[int(p)] if isinstance(current, list) else current[p]
            except (KeyError, IndexError, ValueError, TypeError):
                current = object()
            if current != op.get("value"):
                raise ApiStatus(
                    422,
                    "Invalid",
                    f"the server rejected our request: test of {op.get('path')} failed",
                )
            continue
        if kind in ("move", "copy"):
            source: Any = doc
            for p in _pointer(op["from"]):
                source = source[int(p)] if isinstance(source, list) else source[p]
            value = copy.deepcopy(source)
            if kind == "move":
                doc = json_patch(doc, [{"op": "remove", "path": op["from"]}])
            doc = json_patch(doc, [{"op": "add", "path": op["path"], "value": value}])
            continue
        if not parts:
            if kind in ("add", "replace"):
                doc = copy.deepcopy(op["value"])
                continue
            raise ApiStatus(422, "Invalid", "cannot remove the whole document")
        parent: Any = doc
        try:
            for p in parts[:-1]:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            last = parts[-1]
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(index, copy.deepcopy(op["value"]))
                elif kind == "remove":
                    parent.pop(index)
                elif kind == "replace":
                    parent[index] = copy.deepcopy(op["value"])
            else:
                if kind in ("remove", "replace") and last not in parent:
                    raise KeyError(last)
                if kind == "remove":
                    del parent[last]
                elif kind in ("add", "replace"):
                    parent[last] = copy.deepcopy(op["value"])
                else:
                    raise ApiStatus(422, "Invalid", f"unknown JSON-patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as error:
            raise ApiStatus(
                422, "Invalid", f"JSON patch {kind} {op.get('path')}: {error!r}"
            ) from None
    return doc


def human_age(timestamp: str | None) -> str:
    """Like kubectl's AGE column (k8s.io/apimachinery duration.HumanDuration)."""
    if not timestamp:
        return "<unknown>"
    then = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    s = max(0, int((datetime.now(UTC) - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    m, h, d = s // 60, s // 3600, s // 86400
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if h < 3:
        return f"{m}m"
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if d < 8:
        return f"{d}d{h % 24}h" if h % 24 else f"{d}d"
    return f"{d}d" if d < 730 else f"{d // 365}y"


def _jsonpath(obj: Any, path: str) -> Any:
    current = obj
    for part in path.strip(".").split("."):
        if not isinstance(current, dict):
            return None
        current = current.get(part)
    return current


# ----------------------------------------------------------------------- emulator


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with the gaps docs/build.md lists closed (see the module docstring)."""

    types: dict[tuple[str, str], ResourceType] = attrs.field(factory=dict, init=False)
    store: dict[tuple[str, str, str | None, str], dict[str, Any]] = attrs.field(
        factory=dict, init=False
    )
    rv: int = attrs.field(default=1, init=False)
    log_rvs: list[int] = attrs.field(factory=list, init=False)
    log: list[tuple[tuple[str, str], str, dict[str, Any]]] = attrs.field(factory=list, init=False)
    changed: asyncio.Event | None = attrs.field(default=None, init=False)
    request_count: int = attrs.field(default=0, init=False)
    faults: list[tuple[str, str, int]] = attrs.field(factory=list, init=False)
    """(method, plural, status): the next such request is answered with that status, once
    each, as an API server in trouble answers (503 while etcd elects a leader, …)."""
    graceful_pods: bool = attrs.field(default=False, kw_only=True)
    """Delete pods bound to a node the way a real API server does: mark them Terminating
    (deletionTimestamp, deletionGracePeriodSeconds) and let their kubelet remove them
    with a grace of 0 once the containers have stopped (the test cluster's kubelets)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for rt in BUILTIN:
            self._register(rt)
        # The namespaces every cluster starts with, each with its `default` account.
        for name in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self._write_create(self.types[("", "namespaces")], None, {"metadata": {"name": name}})

    # ---------------------------------------------------------------- discovery
    def _register(self, rt: ResourceType) -> None:
        self.types[rt.key] = rt
        self.resources[kmock.resource(rt.group, rt.version, rt.plural)] = kmock.ResourceInfo(
            kind=rt.kind,
            singular=rt.singular or rt.kind.lower(),
            namespaced=rt.namespaced,
            verbs=ALL_VERBS,
            shortnames=rt.short_names,
            subresources=rt.subresources,
        )

    def _unregister(self, group: str, plural: str) -> None:
        rt = self.types.pop((group, plural), None)
        if rt is not None:
            key = kmock.resource(rt.group, rt.version, rt.plural)
            if key in self.resources:
                del self.resources[key]

    async def _serve_version(self, request: kmock.Request) -> Any:
        payload = await super()._serve_version(request)
        if request.resource is not None and request.resource.group == "":
            payload["groupVersion"] = "v1"  # not "/v1"
        for resource in payload.get("resources", []):
            if "/" in resource["name"]:  # subresources have no short names of their own
                resource["shortNames"] = []
        return payload

    # ------------------------------------------------------------------ serving
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        self.request_count += 1
        route = parse_route(raw.path)
        if route is None:
            return await super().__call__(raw)
        if self.changed is None:
            self.changed = asyncio.Event()
        try:
            for planted in list(self.faults):
                if planted[:2] == (raw.method, route.plural):
                    self.faults.remove(planted)
                    raise ApiStatus(planted[2], "ServiceUnavailable", "planted: try again later")
            rt = self.types.get((route.group, route.plural))
            if rt is None or rt.version != route.version:
                raise ApiStatus(
                    404,
                    "NotFound",
                    f"the server could not find the requested resource ({raw.path})",
                )
            return await self._serve(raw, rt, route)
        except ApiStatus as status:
            return aiohttp.web.json_response(status.body(), status=status.code)

    async def _serve(self, raw: aiohttp.web.BaseRequest, rt: ResourceType, route: Route) -> Any:
        q = raw.query
        method = raw.method
        if route.sub == "eviction" and rt.kind == "Pod" and method == "POST" and route.name:
            body = json.loads(await raw.text() or "{}")
            return self._json(self._evict(rt, route, body, q), 201)
        if route.sub not in (None, "status"):
            raise ApiStatus(404, "NotFound", f"subresource {route.sub!r} is not served")
        if method == "GET" and q.get("watch") in ("true", "1"):
            return await self._watch(raw, rt, route)
        if method == "GET" and route.name is None:
            return self._list(raw, rt, route)
        if method == "GET":
            return self._json(self._get(rt, route.namespace, route.name))
        body: Any = None
        if raw.body_exists:  # not can_read_body: false once a wrapper has read it
            text = await raw.text()
            try:
                body = json.loads(text) if text else None
            except ValueError:
                if method != "DELETE":  # DeleteOptions may come as protobuf: defaults then
                    raise ApiStatus(
                        415,
                        "UnsupportedMediaType",
                        f"only JSON bodies are served, not {raw.content_type}",
                    ) from None
        validation = q.get("fieldValidation", "Warn")
        if method == "POST" and route.name is None:
            obj, warnings = self._write_create(rt, route.namespace, body, validation)
            return self._json(obj, 201, warnings)
        if method == "PATCH" and route.name:
            ctype = raw.content_type
            obj, warnings = self._write_patch(rt, route, body, ctype, validation)
            return self._json(obj, 200, warnings)
        if method == "PUT" and route.name:
            obj, warnings = self._write_put(rt, route, body, validation)
            return self._json(obj, 200, warnings)
        if method == "DELETE" and route.name:
            return self._json(self._write_delete(rt, route.namespace, route.name, body, q))
        raise ApiStatus(405, "MethodNotAllowed", f"{method} is not supported on {raw.path}")

    def _json(self, obj: Any, status: int = 200, warnings: list[str] | None = None) -> Any:
        headers = {"Warning": ", ".join(f'299 - "{w}"' for w in warnings)} if warnings else None
        return aiohttp.web.json_response(obj, status=status, headers=headers)

    # ------------------------------------------------------------------- reading
    def _get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.store.get((*rt.key, namespace if rt.namespaced else None, name))
        if obj is None:
            raise ApiStatus(
                404,
                "NotFound",
                f'{rt.plural}{"." + rt.group if rt.group else ""} "{name}" not found',
                {"name": name, "group": rt.group, "kind": rt.plural},
            )
        return obj

    def _matching(self, rt: ResourceType, route: Route, q: Any) -> list[dict[str, Any]]:
        out = []
        for (group, plural, ns, _name), obj in self.store.items():
            if (group, plural) != rt.key or (route.namespace and ns != route.namespace):
                continue
            if label_match(
                q.get("labelSelector"), obj["metadata"].get("labels") or {}
            ) and field_match(q.get("fieldSelector"), obj):
                out.append(obj)
        return sorted(
            out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"])
        )

    def _list(self, raw: aiohttp.web.BaseRequest, rt: ResourceType, route: Route) -> Any:
        items = self._matching(rt, route, raw.query)
        if "as=Table" in raw.headers.get("Accept", ""):
            return aiohttp.web.json_response(self._table(rt, items))
        return aiohttp.web.json_response(
            {
                "apiVersion": rt.api_version,
                "kind": f"{rt.kind}List",
                "metadata": {"resourceVersion": str(self.rv)},
                "items": items,
            }
        )

    def _table(self, rt: ResourceType, items: list[dict[str, Any]]) -> dict[str, Any]:
        """Server-side printing: NAME, the CRD's printer columns (AGE included)."""
        columns = [
            {
                "name": "Name",
                "type": "string",
                "format": "name",
                "priority": 0,
                "description": "Name of the object",
            }
        ]
        extra = rt.printer_columns or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
        ]
        for col in extra:
            columns.append(
                {
                    "name": col["name"],
                    "type": col["type"],
                    "format": "",
                    "priority": col.get("priority", 0),
                    "description": col.get("description", ""),
                }
            )
        rows = []
        for obj in items:
            cells = [obj["metadata"]["name"]]
            for col in extra:
                value = _jsonpath(obj, col["jsonPath"])
                cells.append(human_age(value) if col["type"] == "date" else value)
            rows.append(
                {
                    "cells": cells,
                    "object": {
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": obj["metadata"],
                    },
                }
            )
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.rv)},
            "columnDefinitions": columns,
            "rows": rows,
        }

    async def _watch(self, raw: aiohttp.web.BaseRequest, rt: ResourceType, route: Route) -> Any:
        q = raw.query
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(q.get("timeoutSeconds") or 1800)
        bookmarks = q.get("allowWatchBookmarks") == "true"
        since = q.get("resourceVersion")

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        def visible(obj: dict[str, Any]) -> bool:
            meta = obj["metadata"]
            if route.namespace and meta.get("namespace") != route.namespace:
                return False
            if route.name and meta.get("name") != route.name:
                return False
            return label_match(q.get("labelSelector"), meta.get("labels") or {}) and field_match(
                q.get("fieldSelector"), obj
            )

        try:
            if not since or since == "0" or q.get("sendInitialEvents") == "true":
                cursor = self.rv
                for obj in self._matching(rt, route, {}):
                    if visible(obj):
                        await send("ADDED", obj)
                if q.get("sendInitialEvents") == "true":
                    await send(
                        "BOOKMARK",
                        {
                            "kind": rt.kind,
                            "apiVersion": rt.api_version,
                            "metadata": {
                                "resourceVersion": str(cursor),
                                "annotations": {"k8s.io/initial-events-end": "true"},
                            },
                        },
                    )
            else:
                try:
                    cursor = int(since)
                except ValueError:
                    cursor = self.rv
                if self.log_rvs and cursor < self.log_rvs[0] - 1:
                    await send(
                        "ERROR",
                        ApiStatus(410, "Expired", f"too old resource version: {cursor}").body(),
                    )
                    return response
            while loop.time() < deadline:
                start = bisect.bisect_right(self.log_rvs, cursor)
                if start < len(self.log_rvs):
                    for i in range(start, len(self.log_rvs)):
                        key, kind, obj = self.log[i]
                        cursor = self.log_rvs[i]
                        if key == rt.key and visible(obj):
                            await send(kind, obj)
                    continue
                self.changed.clear()
                try:
                    await asyncio.wait_for(
                        self.changed.wait(), timeout=min(5.0, deadline - loop.time())
                    )
                except TimeoutError:
                    if bookmarks:
                        await send(
                            "BOOKMARK",
                            {
                                "kind": rt.kind,
                                "apiVersion": rt.api_version,
                                "metadata": {"resourceVersion": str(cursor)},
                            },
                        )
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        return response

    # ------------------------------------------------------------------- writing
    def _emit(self, rt: ResourceType, kind: str, obj: dict[str, Any]) -> None:
        self.log_rvs.append(self.rv)
        self.log.append((rt.key, kind, copy.deepcopy(obj)))
        if len(self.log_rvs) > LOG_LIMIT:
            half = LOG_LIMIT // 2
            del self.log_rvs[:half]
            del self.log[:half]
        if self.changed is not None:
            self.changed.set()

    def terminate_namespace(self, name: str) -> None:
        """Mark a namespace Terminating, as its deletion does while its content goes (the
        namespace controller's part, removing that content, is not emulated)."""
        namespace = self.store[("", "namespaces", None, name)]
        namespace["metadata"]["deletionTimestamp"] = _now()
        namespace.setdefault("status", {})["phase"] = "Terminating"
        self._bump(namespace)
        self._emit(self.types[("", "namespaces")], "MODIFIED", namespace)

    def _admit_namespace(self, rt: ResourceType, meta: dict[str, Any]) -> None:
        """The NamespaceLifecycle admission plugin: nothing in a namespace that does not
        exist (404, as kube-apiserver answers `kubectl create -n missing`), and nothing new
        in one being deleted."""
        namespace = self.store.get(("", "namespaces", None, meta["namespace"]))
        if namespace is None:
            raise ApiStatus(
                404,
                "NotFound",
                f'namespaces "{meta["namespace"]}" not found',
                {"name": meta["namespace"], "kind": "namespaces"},
            )
        if namespace["metadata"].get("deletionTimestamp"):
            raise ApiStatus(
                403,
                "Forbidden",
                f'{rt.plural} "{meta["name"]}" is forbidden: unable to create new content in '
                f"namespace {meta['namespace']} because it is being terminated",
            )

    def _admit_service_account(self, pod: dict[str, Any]) -> None:
        """The ServiceAccount admission plugin: a pod names `default` unless it names one,
        and one whose account does not exist is refused (403, kube-apiserver's message),
        so a job naming a missing account fails at pod creation, as on a cluster."""
        meta, spec = pod["metadata"], pod.setdefault("spec", {})
        account = spec.get("serviceAccountName") or "default"
        spec["serviceAccountName"] = account
        if ("", "serviceaccounts", meta["namespace"], account) not in self.store:
            raise ApiStatus(
                403,
                "Forbidden",
                f'pods "{meta["name"]}" is forbidden: error looking up service account '
                f'{meta["namespace"]}/{account}: serviceaccount "{account}" not found',
                {"name": meta["name"], "kind": "pods"},
            )

    def _namespace_created(self, namespace: dict[str, Any]) -> None:
        """The service-account controller's part: every namespace gets its `default`
        account as it is created (a cluster adds it within a second)."""
        name = namespace["metadata"]["name"]
        account = {"metadata": {"name": "default", "namespace": name}}
        self._write_create(self.types[("", "serviceaccounts")], name, account)

    def lose(self, group: str, plural: str, namespace: str | None, name: str) -> None:
        """Delete an object as a watch gap loses it: no DELETED event is ever sent, and
        the event log is cut, so a watch resuming from before gets 410 Gone (what a real
        API server answers once its watch cache has moved on) and lists again."""
        del self.store[(group, plural, namespace, name)]
        self.rv += 1
        # The log starts after the gap: one entry of no type, which no watch sends.
        self.log_rvs[:] = [self.rv]
        self.log[:] = [(("", ""), "MODIFIED", {"metadata": {}})]

    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def _check_core(
        self, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        """kube-apiserver's validation of the built-in objects the operator creates (a
        422 naming each field, as ValidatePod & co. write it; core_validation.py)."""
        if rt.group or rt.kind not in ("Pod", "Service", "ConfigMap", "Secret"):
            return
        found = core_validation.problems(rt.kind, obj)
        if old is not None and rt.kind == "Pod":
            found += core_validation.pod_update_problems(old, obj)
        if not found:
            return
        name = obj.get("metadata", {}).get("name", "")
        text = ", ".join(str(p) for p in found)
        raise ApiStatus(
            422,
            "Invalid",
            f'{rt.kind} "{name}" is invalid: ' + (f"[{text}]" if len(found) > 1 else text),
            {
                "name": name,
                "kind": rt.kind,
                "causes": [
                    {"reason": p.reason, "message": p.message, "field": p.field} for p in found
                ],
            },
        )

    def _check_custom(
        self, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None, validation: str
    ) -> tuple[dict[str, Any], list[str]]:
        if rt.schema is None:
            return obj, []
        pruned, problems, warnings = crd_validation.validate(obj, rt.schema, old, validation)
        if problems:
            name = obj.get("metadata", {}).get("name", "")
            text = ", ".join(str(p) for p in problems)
            message = f'{rt.kind}.{rt.group} "{name}" is invalid: ' + (
                f"[{text}]" if len(problems) > 1 else text
            )
            causes = [
                {"reason": p.reason, "message": p.message, "field": p.field} for p in problems
            ]
            raise ApiStatus(
                422,
                "Invalid",
                message,
                {"name": name, "group": rt.group, "kind": rt.kind, "causes": causes},
            )
        return pruned, warnings

    def _write_create(
        self, rt: ResourceType, namespace: str | None, body: Any, validation: str = "Strict"
    ) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(body, dict) or not isinstance(body.get("metadata"), dict):
            raise ApiStatus(400, "BadRequest", "the object has no metadata")
        obj = copy.deepcopy(body)
        meta = obj["metadata"]
        obj.setdefault("apiVersion", rt.api_version)
        obj.setdefault("kind", rt.kind)
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiStatus(
                    422,
                    "Invalid",
                    f"{rt.kind}: metadata.name: Required value: name or generateName is required",
                )
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if rt.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise ApiStatus(
                    400,
                    "BadRequest",
                    "the namespace of the object does not match the namespace of the request",
                )
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        key = (*rt.key, meta.get("namespace"), meta["name"])
        if rt.namespaced:
            self._admit_namespace(rt, meta)
        if rt.kind == "Pod":
            self._admit_service_account(obj)
        self._check_core(rt, obj, None)
        if rt.namespaced:
            self._admit_quota(rt, obj)
        if key in self.store:
            raise ApiStatus(
                409,
                "AlreadyExists",
                f'{rt.plural} "{meta["name"]}" already exists',
                {"name": meta["name"], "group": rt.group, "kind": rt.plural},
            )
        if "status" in rt.subresources and rt.kind not in ("Pod", "Namespace", "Service"):
            obj.pop("status", None)
        obj, warnings = self._check_custom(rt, obj, None, validation)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if rt.kind == "Pod":
            obj.setdefault("status", {"phase": "Pending"})
            if obj.get("spec", {}).get("schedulingGates"):
                # kube-apiserver's PrepareForCreate (applySchedulingGatedCondition).
                obj["status"]["conditions"] = [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "SchedulingGated",
                        "message": "Scheduling is blocked due to non-empty scheduling gates",
                        "lastTransitionTime": _now(),
                    }
                ]
        if rt.kind == "Namespace":
            obj["status"] = {"phase": "Active"}
        if rt.kind == "CustomResourceDefinition":
            self._crd_created(obj)
        self._bump(obj)
        self.store[key] = obj
        self._emit(rt, "ADDED", obj)
        if rt.kind == "Namespace":
            self._namespace_created(obj)
        return obj, warnings

    def _admit_quota(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        """The ResourceQuota admission plugin: refuse a create over the namespace's quota."""
        namespace, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        quotas, existing = [], []
        for (group, plural, ns, _name), stored in self.store.items():
            if ns != namespace:
                continue
            if (group, plural) == ("", "resourcequotas"):
                quotas.append(stored)
            elif (group, plural) == rt.key:
                existing.append(stored)
        why = quota.refusal(obj, rt.plural, quotas, existing) if quotas else None
        if why is not None:
            raise ApiStatus(
                403,
                "Forbidden",
                f'{rt.plural} "{name}" is forbidden: {why}',
                {"name": name, "kind": rt.plural},
            )

    def _crd_created(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        served = [v for v in spec["versions"] if v.get("served", True)]
        version = next((v for v in served if v.get("storage")), served[0])
        self._register(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                subresources=tuple((version.get("subresources") or {}).keys()),
                short_names=tuple(names.get("shortNames") or ()),
                singular=names.get("singular", ""),
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=list(version.get("additionalPrinterColumns") or []),
            )
        )
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [version["name"]],
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "lastTransitionTime": _now(),
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "lastTransitionTime": _now(),
                },
            ],
        }

    def _update(
        self, rt: ResourceType, route: Route, old: dict[str, Any], new: Any, validation: str
    ) -> tuple[dict[str, Any], list[str]]:
        if not isinstance(new, dict):
            raise ApiStatus(422, "Invalid", "the patched object is not an object")
        new = copy.deepcopy(new)
        new_meta = new.setdefault("metadata", {})
        old_meta = old["metadata"]
        wanted_rv = new_meta.get("resourceVersion")
        if wanted_rv and wanted_rv != old_meta["resourceVersion"]:
            raise ApiStatus(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {rt.plural} "{old_meta["name"]}": the '
                "object has been modified; please apply your changes to the latest "
                "version and try again",
            )
        for key in (
            "uid",
            "creationTimestamp",
            "name",
            "namespace",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "resourceVersion",
        ):
            if key in old_meta:
                new_meta[key] = old_meta[key]
            else:
                new_meta.pop(key, None)
        new["apiVersion"], new["kind"] = old.get("apiVersion"), old.get("kind")
        if "status" in rt.subresources:
            if route.sub == "status":
                new = {
                    **{k: v for k, v in old.items() if k != "status"},
                    **({"status": new["status"]} if "status" in new else {}),
                }
            elif "status" in old:
                new["status"] = old["status"]
            else:
                new.pop("status", None)
        new, warnings = self._check_custom(rt, new, old, validation)
        if new == old:
            return old, warnings
        self._check_core(rt, new, old)
        spec_changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in old.items() if k not in ("metadata", "status")
        }
        if spec_changed:
            new["metadata"]["generation"] = old_meta.get("generation", 1) + 1
        self._bump(new)
        key = (*rt.key, old_meta.get("namespace"), old_meta["name"])
        terminating_pod = self.graceful_pods and _grace(rt, new, None, {}) > 0
        if (
            new["metadata"].get("deletionTimestamp")
            and not new["metadata"].get("finalizers")
            and not terminating_pod  # its kubelet still reports on it, then deletes it
        ):
            self.store.pop(key, None)
            self._emit(rt, "DELETED", new)
            self._collect_garbage(new["metadata"]["uid"])
            return new, warnings
        self.store[key] = new
        self._emit(rt, "MODIFIED", new)
        return new, warnings

    def _write_patch(
        self, rt: ResourceType, route: Route, patch: Any, ctype: str, validation: str
    ) -> tuple[dict[str, Any], list[str]]:
        old = self._get(rt, route.namespace, route.name or "")
        if ctype == "application/json-patch+json":
            if not isinstance(patch, list):
                raise ApiStatus(400, "BadRequest", "a JSON patch must be a list of operations")
            new = json_patch(old, patch)
            if isinstance(new, dict):  # JSON patches carry their preconditions as `test` ops
                new.get("metadata", {}).pop("resourceVersion", None)
        elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            new = merge_patch(old, patch)
            rv = (
                (patch or {}).get("metadata", {}).get("resourceVersion")
                if isinstance(patch, dict)
                else None
            )
            new.setdefault("metadata", {})
            if rv:
                new["metadata"]["resourceVersion"] = rv
            else:
                new["metadata"].pop("resourceVersion", None)
        else:
            raise ApiStatus(
                415, "UnsupportedMediaType", f"the patch type {ctype!r} is not supported"
            )
        return self._update(rt, route, old, new, validation)

    def _write_put(
        self, rt: ResourceType, route: Route, body: Any, validation: str
    ) -> tuple[dict[str, Any], list[str]]:
        old = self._get(rt, route.namespace, route.name or "")
        return self._update(rt, route, old, body, validation)

    def _evict(self, rt: ResourceType, route: Route, body: Any, q: Any) -> dict[str, Any]:
        """POST pods/NAME/eviction (what `kubectl drain` sends for each pod): as the real
        server with no PodDisruptionBudget in the way, the DisruptionTarget condition
        (reason EvictionByEvictionAPI), then a graceful delete with the Eviction's
        deleteOptions."""
        key = (*rt.key, route.namespace, route.name)
        obj = copy.deepcopy(self._get(rt, route.namespace, route.name))
        conditions = obj.setdefault("status", {}).setdefault("conditions", [])
        conditions[:] = [c for c in conditions if c.get("type") != "DisruptionTarget"]
        conditions.append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
                "lastTransitionTime": _now(),
            }
        )
        self._bump(obj)
        self.store[key] = obj
        self._emit(rt, "MODIFIED", obj)
        options = (body or {}).get("deleteOptions") if isinstance(body, dict) else None
        self._write_delete(rt, route.namespace, route.name, options, q)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}

    def _write_delete(
        self, rt: ResourceType, namespace: str | None, name: str, body: Any, q: Any
    ) -> dict[str, Any]:
        obj = self._get(rt, namespace, name)
        meta = obj["metadata"]
        key = (*rt.key, namespace if rt.namespaced else None, name)
        # DeleteOptions.preconditions: delete this object, not one created since under
        # its name (the real server's wording).
        wanted = ((body or {}).get("preconditions") if isinstance(body, dict) else None) or {}
        for field_, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
            if wanted.get(field_) and wanted[field_] != meta.get(field_):
                raise ApiStatus(
                    409,
                    "Conflict",
                    f"Precondition failed: {label} in precondition: {wanted[field_]}, "
                    f"{label} in object meta: {meta.get(field_)}",
                )
        policy = (body or {}).get("propagationPolicy") if isinstance(body, dict) else None
        policy = policy or q.get("propagationPolicy") or "Background"
        grace = _grace(rt, obj, body, q) if self.graceful_pods else 0
        if grace and not meta.get("deletionTimestamp"):
            obj = copy.deepcopy(obj)
            # As the real API server: the time the grace period ends, not the request's.
            obj["metadata"]["deletionTimestamp"] = _now(later_s=grace)
            obj["metadata"]["deletionGracePeriodSeconds"] = grace
            self._bump(obj)
            self.store[key] = obj
            self._emit(rt, "MODIFIED", obj)
            return obj
        if grace:  # already Terminating: its kubelet finishes the deletion
            return obj
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                obj = copy.deepcopy(obj)
                obj["metadata"]["deletionTimestamp"] = _now()
                obj["metadata"]["deletionGracePeriodSeconds"] = 0
                self._bump(obj)
                self.store[key] = obj
                self._emit(rt, "MODIFIED", obj)
            return obj
        obj = copy.deepcopy(obj)
        self._bump(obj)
        del self.store[key]
        self._emit(rt, "DELETED", obj)
        if rt.kind == "CustomResourceDefinition":
            self._unregister(obj["spec"]["group"], obj["spec"]["names"]["plural"])
        if policy != "Orphan":
            self._collect_garbage(meta["uid"])
        return obj

    def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion of the objects the deleted one owned."""
        for (group, plural, ns, name), obj in list(self.store.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in owners):
                rt = self.types.get((group, plural))
                if rt is not None and (group, plural, ns, name) in self.store:
                    self._write_delete(rt, ns, name, None, {})


def _grace(rt: ResourceType, obj: dict[str, Any], body: Any, q: Any) -> int:
    """The grace period of a pod deletion: the request's, else the pod's own; 0 for
    objects that are not pods bound to a node (they are removed at once)."""
    if rt.kind != "Pod" or not obj.get("spec", {}).get("nodeName"):
        return 0
    asked = (body or {}).get("gracePeriodSeconds") if isinstance(body, dict) else None
    if asked is None and q.get("gracePeriodSeconds") is not None:
        asked = int(q.get("gracePeriodSeconds"))
    if asked is None:
        asked = obj["spec"].get("terminationGracePeriodSeconds", 30)
    return max(0, int(asked))


async def serve(port_file: Path, port: int = 0, graceful_pods: bool = False) -> None:
    emulator = Emulator(graceful_pods=graceful_pods)
    async with emulator, kmock.Server(emulator, port=port) as server:
        port_file.write_text(str(server.port))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-file", required=True, type=Path)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--graceful-pods",
        action="store_true",
        help="pods on a node terminate through their kubelet",
    )
    args = parser.parse_args()
    asyncio.run(serve(args.port_file, args.port, args.graceful_pods))


if __name__ == "__main__":
    main()
