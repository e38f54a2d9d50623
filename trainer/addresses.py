"""Addresses on IPv4, IPv6 and dual-stack networks: the address pods bind and URLs that
bracket IPv6 literals (`http_server` binds either family).

A pod on an IPv6-only cluster has only an IPv6 address: its servers must listen on one,
and the operator, the kubelet and the trainer reach them at `http://[ADDRESS]:PORT`. The
operator renders `ALL` into its pods; `http_server` binds it dual-stack, so the same pod
spec runs on IPv4, IPv6 and dual-stack clusters alike. Standard library only (the
operator imports it)."""

from __future__ import annotations

import ipaddress

ALL = "::"
"""Every address of the pod, IPv6 and IPv4 (a dual-stack socket); on a kernel without
IPv6, every IPv4 address."""


def http_url(host: str, port: int, path: str = "") -> str:
    """`http://HOST:PORT/PATH`, an IPv6 literal in brackets (RFC 3986)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or a literal, IPv6 with or without brackets) is this
    machine's loopback only: a server bound there is reachable from no other machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface
