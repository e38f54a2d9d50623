"""Cluster DNS through each pod's /etc/hosts: the pod's own names, every pod's
`hostname.subdomain.namespace.svc[.cluster.local]`, and every Service's
`name.namespace.svc[.cluster.local]` mapped to the addresses of the pods it selects.
The kubelet rewrites the file in place as pods come and go (glibc reads it on every
lookup), so names resolve once the pod behind them has an address, as with real DNS."""

from __future__ import annotations

from typing import Any

DOMAIN = "cluster.local"


def _names(*parts: str) -> list[str]:
    base = ".".join(parts)
    return [f"{base}.svc.{DOMAIN}", f"{base}.svc"]


def _selects(service: dict[str, Any], pod: dict[str, Any]) -> bool:
    selector = (service.get("spec") or {}).get("selector") or {}
    labels = pod["metadata"].get("labels") or {}
    same_namespace = service["metadata"].get("namespace") == pod["metadata"].get("namespace")
    return (
        bool(selector) and same_namespace and all(labels.get(k) == v for k, v in selector.items())
    )


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def hosts_file(
    pod: dict[str, Any], ip: str, pods: list[dict[str, Any]], services: list[dict[str, Any]]
) -> str:
    """The /etc/hosts of `pod` (address `ip`) given every pod and Service."""
    meta, spec = pod["metadata"], pod["spec"]
    hostname = spec.get("hostname") or meta["name"]
    own = [hostname]
    if spec.get("subdomain"):
        own = [*_names(hostname, spec["subdomain"], meta["namespace"]), hostname]
    lines = ["127.0.0.1\tlocalhost", f"{ip}\t{' '.join(own)}"]
    for other in pods:
        address = (other.get("status") or {}).get("podIP")
        if not address or other["metadata"].get("uid") == meta.get("uid"):
            continue
        other_spec = other["spec"]
        if other_spec.get("subdomain") and other_spec.get("hostname"):
            names = _names(
                other_spec["hostname"], other_spec["subdomain"], other["metadata"]["namespace"]
            )
            lines.append(f"{address}\t{' '.join(names)}")
    for service in services:
        spec_ = service.get("spec") or {}
        publish_all = spec_.get("publishNotReadyAddresses", False)
        for other in pods:
            address = (other.get("status") or {}).get("podIP")
            if other["metadata"].get("uid") == meta.get("uid"):
                address = ip
            if not address or not _selects(service, other):
                continue
            if publish_all or _ready(other):
                names = _names(service["metadata"]["name"], service["metadata"]["namespace"])
                lines.append(f"{address}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"
