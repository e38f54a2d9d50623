"""A small asynchronous Kubernetes REST client for the handlers' writes.

kopf watches and patches its own resources, but it has no API for creating arbitrary
objects. Rather than pull in a whole client library (and its dependencies) the operator
talks REST over aiohttp, which kopf already uses, with the credentials kopf resolved at
login (kubeconfig or in-cluster service account).
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from rlft.operator import crd, permissions

_PLURALS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Event": "events"}
_PLURALS["Secret"] = "secrets"  # the job's tokens (created only, never read)
_PLURALS["NetworkPolicy"] = "networkpolicies"
_PLURALS["PodGroup"] = "podgroups"  # a gang's (Volcano, coscheduling): operator/gang.py


class ApiError(Exception):
    """A failed API call; `status` is the HTTP status, `message` the API server's own (from
    its Status object: `pods "x" is forbidden: exceeded quota: …`)."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(f"HTTP {status}: {message}")


@dataclass
class Connection:
    """Where the API server is and how to authenticate (from kopf's ConnectionInfo)."""

    server: str
    headers: dict[str, str]
    ssl_context: ssl.SSLContext | bool | None = None

    @classmethod
    def from_kopf(cls, info: Any) -> Connection:
        context: ssl.SSLContext | bool | None = None
        if info.server.startswith("https"):
            context = False if info.insecure else info.as_ssl_context()
        return cls(
            server=info.server.rstrip("/"), headers=info.as_http_headers(), ssl_context=context
        )


def _core_path(namespace: str, plural: str, name: str | None = None, sub: str | None = None) -> str:
    path = f"/api/v1/namespaces/{namespace}/{plural}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def _collection_path(manifest: dict[str, Any]) -> str:
    """Where objects of the manifest's kind are created (its apiVersion's group)."""
    namespace, plural = manifest["metadata"]["namespace"], _PLURALS[manifest["kind"]]
    group, _, version = manifest["apiVersion"].rpartition("/")
    if not group:
        return _core_path(namespace, plural)
    return f"/apis/{group}/{version}/namespaces/{namespace}/{plural}"


def job_path(namespace: str, name: str, sub: str | None = None) -> str:
    path = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{namespace}/{crd.PLURAL}/{name}"
    return path + (f"/{sub}" if sub else "")


class Kube:
    """The calls the operator makes; one aiohttp session, reused.

    Credentials expire (a projected service-account token is rotated by the kubelet,
    hourly where the API server does not extend it): `reconnect` takes kopf's fresh ones
    at each re-login, and a 401 asks `relogin` for the current ones and tries once more.
    """

    def __init__(
        self,
        connection: Connection,
        timeout: float = 30.0,
        relogin: Callable[[], Connection | None] | None = None,
    ):
        self.connection = connection
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._relogin = relogin

    def reconnect(self, connection: Connection) -> None:
        """Use `connection` (new credentials) from the next call on."""
        self.connection = connection

    async def _session_for(self, connection: Connection) -> aiohttp.ClientSession:
        session = self._session
        if session is not None and not session.closed and session.headers == connection.headers:
            return session
        if session is not None:
            await session.close()
        self._session = aiohttp.ClientSession(headers=connection.headers, timeout=self._timeout)
        return self._session

    async def _request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        permissions.require(method, path)  # every call has its RBAC rule in the chart
        status, text = await self._send(method, path, body, content_type)
        if status == 401 and self._relogin is not None:
            fresh = self._relogin()
            if fresh is not None and fresh.headers != self.connection.headers:
                self.reconnect(fresh)
                status, text = await self._send(method, path, body, content_type)
        if status >= 400:
            try:
                message = json.loads(text).get("message", text)
            except (ValueError, AttributeError):
                message = text
            raise ApiError(status, str(message)[:500])
        return json.loads(text) if text else {}

    async def _send(self, method: str, path: str, body: Any, content_type: str) -> tuple[int, str]:
        connection = self.connection
        session = await self._session_for(connection)
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        try:
            async with session.request(
                method,
                connection.server + path,
                data=data,
                headers=headers,
                ssl=connection.ssl_context,
            ) as response:
                return response.status, await response.text()
        except (aiohttp.ClientError, TimeoutError) as error:
            # The API server out of reach is its trouble, not a bug of ours: retried as
            # its 5xx are (a traceback every poll, counted as an error, before).
            # Its str, not its repr: that holds the request's headers, bearer token and all.
            why = f"{type(error).__name__}: {error}"
            raise ApiError(503, f"no answer from the API server: {why}"[:500]) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", path, body)

    async def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", job_path(namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    async def patch_job_status(
        self, namespace: str, name: str, status: dict[str, Any], resource_version: str | None
    ) -> dict[str, Any]:
        """Merge-patch the status; with a resourceVersion it is a precondition (409 when the
        object changed since it was read)."""
        body: dict[str, Any] = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._request(
            "PATCH", job_path(namespace, name, "status"), body, "application/merge-patch+json"
        )

    async def patch_job(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self._request(
            "PATCH", job_path(namespace, name), patch, "application/merge-patch+json"
        )

    async def create(self, manifest: dict[str, Any]) -> bool:
        """Create a namespaced object (core, or a gang's PodGroup); False if it already
        exists. An existing PodGroup gets the manifest's spec and owner: the operator sends
        it before each round of pod creations, and its minimum follows spec.trainer.replicas
        and the rollout instances, which may have changed since the last gang."""
        path = _collection_path(manifest)
        try:
            await self._request("POST", path, manifest)
        except ApiError as error:
            if error.status != 409:
                raise
            if manifest["kind"] == "PodGroup":
                patch = [{"op": "add", "path": "/spec", "value": manifest["spec"]}]
                if owners := manifest["metadata"].get("ownerReferences"):
                    # A job deleted and applied again under its name finds its former
                    # self's PodGroup, which the garbage collector (asynchronous on a
                    # real cluster) is about to delete as that job's: made this job's.
                    patch.append(
                        {"op": "add", "path": "/metadata/ownerReferences", "value": owners}
                    )
                name = f"{path}/{manifest['metadata']['name']}"
                await self._request("PATCH", name, patch, "application/json-patch+json")
            return False
        return True

    async def patch(
        self, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch a namespaced core object (a ConfigMap's data)."""
        return await self._request(
            "PATCH",
            _core_path(namespace, _PLURALS[kind], name),
            patch,
            "application/merge-patch+json",
        )

    async def delete(
        self,
        kind: str,
        namespace: str,
        name: str,
        grace_seconds: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """Delete (with `grace_seconds` 0: force, as `kubectl delete --force` does, for a
        pod whose kubelet is gone); with `uid`, only that object, not one created since
        under its name (a decision about a pod is about the pod observed). False if it was
        already gone or replaced."""
        body: dict[str, Any] = {}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            await self._request("DELETE", _core_path(namespace, _PLURALS[kind], name), body or None)
        except ApiError as error:
            if error.status == 404 or (error.status == 409 and uid is not None):
                return False
            raise
        return True

    async def list_objects(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The namespaced core objects of `kind` the label `selector` matches, as stored now."""
        path = _core_path(namespace, _PLURALS[kind]) + f"?labelSelector={selector}"
        listing = await self._request("GET", path)
        return list(listing.get("items") or [])

    async def list_names(self, kind: str, namespace: str, selector: str) -> list[str]:
        return [
            item["metadata"]["name"] for item in await self.list_objects(kind, namespace, selector)
        ]

    async def post_event(
        self, job: dict[str, Any], type_: str, reason: str, message: str, instance: str
    ) -> None:
        meta = job["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": job.get("apiVersion", f"{crd.GROUP}/{crd.VERSION}"),
                "kind": job.get("kind", "RLFineTune"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "rlft-operator"},
            "reportingComponent": "rlft.dev/operator",
            "reportingInstance": instance[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self.create(event)


async def fetch_json(url: str, timeout: float = 2.0) -> Any | None:
    """GET a JSON document; None on any failure (the trainer may not be up yet)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url) as response,
        ):
            if response.status != 200:
                return None
            return json.loads(await response.text())
    except (TimeoutError, aiohttp.ClientError, ValueError, OSError):
        return None
