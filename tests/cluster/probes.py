"""Container probes as a kubelet runs them, for the test cluster's process kubelet.

`httpGet` startup, liveness and readiness probes (other handlers are not run), with a
kubelet's semantics (pkg/kubelet/prober):

- each probe of a running container has its own worker (a thread here, a goroutine
  there): the first probe `initialDelaySeconds` after the container started, then one
  every `periodSeconds`; an answer slower than `timeoutSeconds`, a refused connection or
  a status outside 200–399 is a failure;
- a result flips after `failureThreshold` failures in a row, or `successThreshold`
  successes in a row;
- while a startup probe has not succeeded, the liveness and readiness probes do not run
  and the container is not started (`started: false`) nor ready; a startup probe that
  fails is a kill;
- a readiness result is the container's `ready` (not ready until it first succeeds);
  without a readiness probe a started container is ready;
- a failed liveness (or startup) probe kills the container as a stop does: SIGTERM, then
  SIGKILL after the probe's `terminationGracePeriodSeconds`, else the pod's. The kubelet
  then restarts it per the pod's `restartPolicy`; with `Never` the pod ends Failed, and
  its status shows only the exit code (137 or 143) and reason Error, as a real one's
  does.

Events as a kubelet posts them (reason `Unhealthy`: "Liveness probe failed: HTTP probe
failed with statuscode: 503"; `Killing`: "Container main failed liveness probe, will be
restarted"), except that a real kubelet posts one for every failed probe and aggregates
them, and this one posts `Unhealthy` once per flip to failure. Standard library only.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KINDS = {"startupProbe": "Startup", "livenessProbe": "Liveness", "readinessProbe": "Readiness"}
"""The container fields of the probes, and how a kubelet's events name them."""


@dataclass(frozen=True)
class ProbeSpec:
    kind: str
    """startupProbe, livenessProbe or readinessProbe."""
    url: str
    initial_delay: float = 0
    period: float = 10
    timeout: float = 1
    success_threshold: int = 1
    failure_threshold: int = 3
    grace: float = 30
    """Seconds between SIGTERM and SIGKILL when this probe kills the container."""

    @property
    def name(self) -> str:
        return KINDS[self.kind]


def probe_specs(container: dict[str, Any], ip: str, pod_grace: float) -> dict[str, ProbeSpec]:
    """The container's httpGet probes, by field; the host defaults to the pod's IP and a
    named port is looked up among the container's ports."""
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
    specs = {}
    for kind in KINDS:
        probe = container.get(kind)
        if not probe or "httpGet" not in probe:
            continue
        get = probe["httpGet"]
        port = get["port"] if isinstance(get["port"], int) else ports[get["port"]]
        scheme = str(get.get("scheme") or "HTTP").lower()
        path = get.get("path") or "/"
        specs[kind] = ProbeSpec(
            kind=kind,
            url=f"{scheme}://{get.get('host') or ip}:{port}{path}",
            initial_delay=probe.get("initialDelaySeconds", 0),
            period=probe.get("periodSeconds", 10),
            timeout=probe.get("timeoutSeconds", 1),
            success_threshold=probe.get("successThreshold", 1),
            failure_threshold=probe.get("failureThreshold", 3),
            grace=probe.get("terminationGracePeriodSeconds") or pod_grace,
        )
    return specs


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""A kubelet probes the pod directly, whatever proxy the environment names."""


def http_check(spec: ProbeSpec) -> tuple[bool, str]:
    """One probe: (succeeded, why not), the why in a kubelet's words."""
    try:
        with _DIRECT.open(spec.url, timeout=spec.timeout) as answer:
            code = answer.status
    except urllib.error.HTTPError as error:
        code = error.code
    except OSError as error:  # refused, reset, timed out
        return False, f'Get "{spec.url}": {error}'
    if 200 <= code < 400:
        return True, ""
    return False, f"HTTP probe failed with statuscode: {code}"


@dataclass
class ProbeState:
    """Consecutive results of one probe, as a prober worker counts them."""

    spec: ProbeSpec
    result: bool | None = None
    """None before the first flip: a startup or readiness probe has not succeeded yet (a
    liveness probe starts as a success, as a kubelet's does)."""
    successes: int = 0
    failures: int = 0

    def __post_init__(self) -> None:
        if self.spec.kind == "livenessProbe":
            self.result = True

    def record(self, ok: bool) -> bool:
        """Count one result; True when the probe's result flipped."""
        before = self.result
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.spec.success_threshold:
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= self.spec.failure_threshold:
                self.result = False
        return self.result != before


@dataclass(frozen=True)
class Kill:
    grace: float
    message: str


@dataclass
class ContainerProbes:
    """The probe workers of one run of a container (a restarted container gets new ones)."""

    name: str
    specs: dict[str, ProbeSpec]
    check: Callable[[ProbeSpec], tuple[bool, str]] = http_check
    started: bool = False
    """The startup probe succeeded (at once without one)."""
    kill: Kill | None = None
    """Set once a liveness or startup probe failed: the kubelet stops the container."""
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type, reason, message) for the kubelet to post."""
    _states: dict[str, ProbeState] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.started = "startupProbe" not in self.specs
        self._states = {kind: ProbeState(spec) for kind, spec in self.specs.items()}

    @property
    def ready(self) -> bool:
        if not self.started or self.kill is not None:
            return False
        readiness = self._states.get("readinessProbe")
        return True if readiness is None else readiness.result is True

    def start(self, started_at: float) -> None:
        for kind in self.specs:
            threading.Thread(
                target=self._work, args=(kind, started_at), daemon=True, name=f"probe-{kind}"
            ).start()

    def stop(self) -> None:
        self._stop.set()

    def drain_events(self) -> list[tuple[str, str, str]]:
        with self._lock:
            events, self.events = self.events, []
        return events

    def _work(self, kind: str, started_at: float) -> None:
        spec = self.specs[kind]
        delay = max(0.0, started_at + spec.initial_delay - time.monotonic())
        if self._stop.wait(delay):
            return
        while not self._stop.is_set():
            if kind == "startupProbe" and self.started:
                return
            if kind == "startupProbe" or self.started:
                begun = time.monotonic()
                ok, why = self.check(spec)
                self.observe(kind, ok, why)
                wait = max(0.0, spec.period - (time.monotonic() - begun))
            else:
                wait = 0.2  # waiting for the startup probe
            if self._stop.wait(wait):
                return

    def observe(self, kind: str, ok: bool, why: str = "") -> None:
        """One probe result of `kind`: what a kubelet's worker and manager do with it."""
        state, spec = self._states[kind], self.specs[kind]
        with self._lock:
            if self._stop.is_set():
                return
            flipped = state.record(ok)
            if flipped and state.result is False:
                self.events.append(("Warning", "Unhealthy", f"{spec.name} probe failed: {why}"))
            if kind == "startupProbe" and state.result is True:
                self.started = True
            if kind in ("livenessProbe", "startupProbe") and state.result is False:
                action = "liveness" if kind == "livenessProbe" else "startup"
                message = f"Container {self.name} failed {action} probe, will be restarted"
                self.kill = Kill(spec.grace, message)
                self.events.append(("Normal", "Killing", message))
                self._stop.set()  # a killed container is probed no more


def event_body(
    pod: dict[str, Any], container: str, node: str, kind: str, reason: str, message: str
) -> dict[str, Any]:
    """An Event about `pod` from this node's kubelet."""
    meta = pod["metadata"]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
            "fieldPath": f"spec.containers{{{container}}}",
        },
        "type": kind,
        "reason": reason,
        "message": message,
        "source": {"component": "kubelet", "host": node},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
