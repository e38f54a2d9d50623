"""The orchestrator's side of the rollout protocol: a pool of instances.

Requests go to the healthy instance with the fewest requests in flight. An instance that
refuses, fails or does not answer within the timeout is marked down and the request is
re-issued to another one; a request therefore yields exactly one answer (no sample lost,
none used twice). Down instances are probed on `/healthz` and come back once they answer.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlft.trainer.rollout.engine import Completion
from rlft.trainer.rollout.protocol import (
    GenerateRequest,
    ProtocolError,
    WeightsRequest,
    completion_from_json,
)
from rlft.trainer.telemetry import liveness


def _answers(url: str) -> bool:
    """Whether an HTTP server answers `url` at all (any status)."""
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class NoInstanceError(RuntimeError):
    """No rollout instance answered within the deadline."""


class RequestFailed(Exception):
    """One attempt at one instance failed (the caller re-issues elsewhere)."""


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    healthy: bool = True
    policy_version: int | None = None
    failures: int = 0
    last_probe: float = 0.0


def http_json(url: str, body: Any | None, timeout: float) -> Any:
    """POST (or GET when body is None) JSON; RequestFailed on any transport or server
    error, ProtocolError on a 400 (a bad request is not retried)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json"},
        method="GET" if data is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")[:500]
        if error.code == 400:
            raise ProtocolError(f"{url}: {text}") from None
        raise RequestFailed(f"{url}: HTTP {error.code} {text}") from None
    except (OSError, json.JSONDecodeError) as error:  # refused, reset, timeout, bad body
        raise RequestFailed(f"{url}: {type(error).__name__}: {error}") from None


@dataclass
class Generated:
    completions: list[Completion]
    policy_version: int
    tokens: int
    seconds: float
    url: str


class RolloutClient:
    """Load-balanced, fault-tolerant generate calls over several instances."""

    def __init__(
        self,
        urls: list[str],
        timeout_s: float = 600.0,
        deadline_s: float = 600.0,
        probe_every_s: float = 1.0,
    ):
        if not urls:
            raise ValueError("a rollout client needs at least one instance URL")
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.timeout_s, self.deadline_s, self.probe_every_s = timeout_s, deadline_s, probe_every_s
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(
            max_workers=max(4, 4 * len(urls)), thread_name_prefix="rollout"
        )
        self.reissued = 0
        """Requests re-issued to another instance after a failure (cumulative)."""

    # --------------------------------------------------------------- instances
    def live(self) -> list[Instance]:
        with self._lock:
            return [i for i in self.instances if i.healthy]

    def mark_down(self, instance: Instance, reason: str) -> None:
        with self._lock:
            if instance.healthy:
                instance.healthy = False
                instance.failures += 1
                instance.last_probe = time.monotonic()
            self._lock.notify_all()

    def probe(self, instance: Instance) -> bool:
        """Ask /healthz; a healthy answer brings the instance back."""
        try:
            answer = http_json(f"{instance.url}/healthz", None, min(5.0, self.timeout_s))
        except (RequestFailed, ProtocolError):
            answer = None
        with self._lock:
            instance.last_probe = time.monotonic()
            if answer and answer.get("ok"):
                instance.healthy = True
                instance.policy_version = answer.get("policy_version")
                self._lock.notify_all()
                return True
            return False

    def _probe_due(self) -> None:
        now = time.monotonic()
        for instance in self.instances:
            if not instance.healthy and now - instance.last_probe >= self.probe_every_s:
                self.probe(instance)

    def _acquire(self, deadline: float) -> Instance:
        while True:
            with self._lock:
                healthy = [i for i in self.instances if i.healthy]
                if healthy:
                    chosen = min(healthy, key=lambda i: i.in_flight)
                    chosen.in_flight += 1
                    return chosen
            if time.monotonic() > deadline:
                raise NoInstanceError(
                    f"no rollout instance answered for {self.deadline_s:.0f} s "
                    f"({', '.join(i.url for i in self.instances)})"
                )
            self._probe_due()
            with self._lock:
                if not any(i.healthy for i in self.instances):
                    self._lock.wait(timeout=self.probe_every_s / 4)

    def _release(self, instance: Instance) -> None:
        with self._lock:
            instance.in_flight -= 1

    # ---------------------------------------------------------------- requests
    def generate(self, request: GenerateRequest) -> Generated:
        """One request, answered exactly once; re-issued while instances fail."""
        deadline = time.monotonic() + self.deadline_s
        body = request.to_json()
        attempt = 0
        while True:
            instance = self._acquire(deadline)
            try:
                answer = http_json(f"{instance.url}/generate", body, self.timeout_s)
            except RequestFailed as error:
                self.mark_down(instance, str(error))
                with self._lock:
                    self.reissued += 1
                attempt += 1
                continue
            finally:
                self._release(instance)
            completions = [completion_from_json(c) for c in answer["completions"]]
            expected = len(request.prompts) * request.n
            if len(completions) != expected:
                raise ProtocolError(
                    f"{instance.url}: {len(completions)} completions for {expected} asked"
                )
            with self._lock:
                instance.policy_version = answer["policy_version"]
            return Generated(
                completions,
                answer["policy_version"],
                answer["tokens"],
                answer["seconds"],
                instance.url,
            )

    def submit(self, request: GenerateRequest) -> Future[Generated]:
        return self._pool.submit(self.generate, request)

    def load_weights(self, instance: Instance, request: WeightsRequest, timeout: float) -> bool:
        """POST /weights to one instance; False (and the instance marked down) on failure."""
        try:
            answer = http_json(f"{instance.url}/weights", request.to_json(), timeout)
        except RequestFailed as error:
            self.mark_down(instance, str(error))
            return False
        with self._lock:
            instance.policy_version = answer["policy_version"]
        return True

    def wait_reachable(self, timeout_s: float, log: Callable[[str], None] | None = None) -> None:
        """Block until every instance's server answers /healthz at all (503 too: it may
        have no weights yet); fail naming the first one that does not."""
        deadline = time.monotonic() + timeout_s
        for index, instance in enumerate(self.instances):
            told = False
            while not _answers(f"{instance.url}/healthz"):
                if time.monotonic() > deadline:
                    raise NoInstanceError(
                        f"rollout instance {index} ({instance.url}) did not answer /healthz "
                        f"within {timeout_s:.0f} s: check that its pod is running"
                    )
                if not told and log is not None:
                    log(f"rlft: waiting for rollout instance {index} at {instance.url}")
                    told = True
                liveness.beat(f"waiting for rollout instance {index} to start")  # bounded
                time.sleep(0.5)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every instance answers /healthz (weights loaded)."""
        deadline = time.monotonic() + timeout_s
        for instance in self.instances:
            instance.healthy = False
            while not self.probe(instance):
                if time.monotonic() > deadline:
                    raise NoInstanceError(
                        f"{instance.url} did not become ready in {timeout_s:.0f} s"
                    )
                liveness.beat("waiting for the rollout instances' weights")  # bounded
                time.sleep(0.1)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
