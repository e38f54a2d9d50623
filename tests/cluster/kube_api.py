"""A small JSON client of the (emulated) Kubernetes API for the kubelets and the
scheduler: list, get, create, merge-patch (also the status subresource), delete."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Any


class ApiError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


def core_path(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """/api/v1/[namespaces/NS/]KINDs[/NAME] for core resources."""
    path = "/api/v1"
    if namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{kind}"
    if name is not None:
        path += f"/{name}"
    return path


class Api:
    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", content_type)
        request.add_header("Accept", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            with contextlib.suppress(ValueError):
                detail = json.loads(detail).get("message", detail)
            raise ApiError(error.code, detail) from None
        return json.loads(text) if text else None

    def list(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.request("GET", core_path(kind, namespace))["items"]

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", core_path(kind, namespace, name))
        except ApiError as error:
            if error.code == 404:
                return None
            raise

    def create(self, kind: str, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", core_path(kind, namespace), body)

    def patch(
        self, kind: str, namespace: str | None, name: str, patch: Any, status: bool = False
    ) -> dict[str, Any]:
        path = core_path(kind, namespace, name) + ("/status" if status else "")
        content_type = (
            "application/json-patch+json"
            if isinstance(patch, list)
            else "application/merge-patch+json"
        )
        return self.request("PATCH", path, patch, content_type)

    def delete(self, kind: str, namespace: str | None, name: str, grace: int | None = None) -> Any:
        body = {} if grace is None else {"gracePeriodSeconds": grace}
        try:
            return self.request("DELETE", core_path(kind, namespace, name), body)
        except ApiError as error:
            if error.code == 404:
                return None
            raise
