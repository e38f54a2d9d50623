"""The orchestrator's side of the rollout protocol: a pool of instances.

Requests go to the healthy instance with the fewest requests in flight. An instance that
refuses, fails or does not answer within the timeout is marked down and the request is
re-issued to another one; a request therefore yields exactly one answer (no sample lost,
none used twice).

A thread of the client probes down instances on `/healthz` every `probe_every_s`, also
while others are healthy: one timeout or one 500 must not cost an instance (its capacity
and its weight loads) for the rest of the run. An instance that answers is live again,
so the next weight publication reaches it (the publisher ships to `live()`), but it takes
generate requests only once it serves the newest version an instance acknowledged
loading: while it was down it missed publications, and its samples would be stale. It
catches up by that next publication (or, seen by the probes, by a load of its own that
finished after the client gave up on it, or a restart that read the store). The probes
never post weights themselves: the publisher stays the one writer of an instance's
weights, so two loads can never land out of order. A load goes to any instance that
answers, `loadable()`: one with no weights yet answers /healthz 503, and only a load
brings it up. An instance that acknowledges a load is live.

An instance that refuses a request for its content (400: a prompt longer than the
model's context, a temperature below the protocol's least) would refuse it anywhere: the
request is not re-sent, and `generate` raises the ProtocolError naming the cause.

`close()` ends the client: requests in flight or queued stop at their next attempt,
instead of retrying servers stopped with the run until `deadline_s`.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlft.trainer.api_token import TOKEN_ENV, auth_header, given_token
from rlft.trainer.rollout.engine import Completion
from rlft.trainer.rollout.pipeline import StopWaiting, never
from rlft.trainer.rollout.protocol import (
    GenerateRequest,
    ProtocolError,
    SupersededGangError,
    WeightsRequest,
    completion_from_json,
)
from rlft.trainer.telemetry import liveness

log = logging.getLogger("rlft.rollout")


def _healthz(url: str, timeout: float) -> tuple[bool, Any]:
    """(whether a server answered `url` at all, any status; its JSON body, if any)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return True, json.loads(response.read())
    except urllib.error.HTTPError as error:  # 503: no weights yet; still a server
        try:
            return True, json.loads(error.read())
        except (OSError, http.client.HTTPException, ValueError):
            return True, None
    except (OSError, http.client.HTTPException):  # a garbled answer is no server yet
        return False, None
    except ValueError:  # a 200 whose body is not JSON
        return True, None


class NoInstanceError(RuntimeError):
    """No rollout instance answered within the deadline."""


class ClientClosed(RuntimeError):
    """The client was closed while a request waited for an instance or was re-issued."""


class RequestFailed(Exception):
    """One attempt at one instance failed (the caller re-issues elsewhere)."""


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    healthy: bool = True
    """Answers: it gets weight publications (`live()`), and requests once it serves the
    current version."""
    policy_version: int | None = None
    failures: int = 0
    last_probe: float = 0.0
    loads: int = 0
    """Weight loads it acknowledged: a version read across one is older than its own."""
    server_id: str | None = None
    """The server process that answered the last probe (a restart draws a new one)."""
    last_error: str | None = None
    """Why its last request or load failed (named when the client gives up)."""
    answers: bool = False
    """Its last probe got an HTTP answer, of any status, and nothing failed since: a
    weight load may go to it (`loadable()`), weights or not."""


def _refusal(text: str) -> str:
    """The reason a 400's JSON body gives, else its text."""
    try:
        reason = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text
    return reason if isinstance(reason, str) else text


def http_json(url: str, body: Any | None, timeout: float, token: str | None = None) -> Any:
    """POST (or GET when body is None) JSON, with the rollout token when given;
    RequestFailed on any transport or server error, ProtocolError on a 400 (a bad request
    is not retried), SupersededGangError on a 409 (weights from a replaced gang)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json", **auth_header(token)},
        method="GET" if data is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            text = error.read().decode(errors="replace")[:500]
        except (OSError, http.client.HTTPException) as cut:  # the error body was cut off
            text = f"(body unreadable: {type(cut).__name__})"
        if error.code == 400:  # the request's own fault: every instance would refuse it
            raise ProtocolError(
                f"{url}: HTTP 400, the rollout instance refused the request itself (it is "
                f"not sent to another instance): {_refusal(text)}"
            ) from None
        if error.code == 409:  # a newer gang of the job took over the instance
            raise SupersededGangError(f"{url}: {_refusal(text)}") from None
        if error.code == 401:  # another job's instance at this address, or a token edited
            text = f"refused this client's rollout token ({TOKEN_ENV}): {text}"
        raise RequestFailed(f"{url}: HTTP {error.code} {text}") from None
    except (OSError, http.client.HTTPException, ValueError) as error:
        # Refused, reset, timeout; an answer cut off mid-body (a pod killed while writing:
        # IncompleteRead, no OSError); a body that is not JSON, or one cut short where no
        # length was announced (ValueError: JSONDecodeError, UnicodeDecodeError).
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
        deadline_s: float | None = None,
        probe_every_s: float = 1.0,
        token: str | None = None,
    ):
        """`timeout_s`: one attempt of a request; `deadline_s`: the request's attempts
        together (default twice `timeout_s`: a request that timed out on a stalled
        instance is re-issued at least once; equal, it never was, and one stalled
        instance ended the run). `token`: the bearer token of the instances' POSTs
        (default: $RLFT_ROLLOUT_TOKEN, which the operator gives each trainer pod)."""
        if not urls:
            raise ValueError("a rollout client needs at least one instance URL")
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.token = given_token(token or None)
        self.timeout_s, self.probe_every_s = timeout_s, probe_every_s
        self.deadline_s = 2 * timeout_s if deadline_s is None else deadline_s
        self._lock = threading.Condition()
        self._pool = ThreadPoolExecutor(
            max_workers=max(4, 4 * len(urls)), thread_name_prefix="rollout"
        )
        self.reissued = 0
        """Requests re-issued to another instance after a failure (cumulative)."""
        self._current: int | None = None
        """The newest version an instance acknowledged loading (None before the first
        load: the instances serve what they started from)."""
        self._closed = False
        # Its own thread: a probe of a stopped instance waits out its timeout, which would
        # hold up the generate call that happened to run it.
        self._prober = threading.Thread(target=self._probe_loop, name="rollout-probe", daemon=True)
        self._prober.start()

    # --------------------------------------------------------------- instances
    def live(self) -> list[Instance]:
        """The instances that serve weights and answer (a broadcast's members)."""
        with self._lock:
            return [i for i in self.instances if i.healthy]

    def loadable(self) -> list[Instance]:
        """The instances a weight load may go to: the live ones, and those down that
        answered their last probe (one with no weights yet, or whose last load failed)."""
        with self._lock:
            return [i for i in self.instances if i.healthy or i.answers]

    def behind(self, version: int) -> list[Instance]:
        """The loadable instances that serve an older version than `version`, or none."""
        with self._lock:
            return [
                i
                for i in self.instances
                if (i.healthy or i.answers)
                and (i.policy_version is None or i.policy_version < version)
            ]

    @property
    def current_version(self) -> int | None:
        with self._lock:
            return self._current

    def _usable(self, instance: Instance) -> bool:
        """Healthy and serving the current version (call with the lock held)."""
        if not instance.healthy:
            return False
        if instance.policy_version is None:
            # Not probed yet (before the first load it serves what it started from), or
            # its /healthz named no version: a load failed part-way there, and it
            # refuses requests until the next load (before the first one, each request
            # went there, was refused and re-issued, round and round).
            return self._current is None and not instance.last_probe
        return self._current is None or instance.policy_version >= self._current

    def usable(self) -> list[Instance]:
        """The instances generate requests go to."""
        with self._lock:
            return [i for i in self.instances if self._usable(i)]

    def mark_down(self, instance: Instance, reason: str) -> None:
        reason = reason[:500]
        with self._lock:
            instance.last_error = reason
            instance.answers = False  # until a probe hears from it again
            if instance.healthy:
                instance.healthy = False
                instance.failures += 1
                instance.last_probe = time.monotonic()
                log.warning("rollout instance %s failed: %s", instance.url, reason)
            self._lock.notify_all()

    def failures(self) -> str:
        """The instances' last errors, for an error message ("" when none failed)."""
        with self._lock:
            return self._failures()

    def _failures(self) -> str:
        """The instances' last errors, for a give-up message (call with the lock held)."""
        named = [f"{i.url}: {i.last_error}" for i in self.instances if i.last_error]
        return f"; last errors: {'; '.join(named)}" if named else ""

    def probe(self, instance: Instance) -> bool:
        """Ask /healthz; True (and the instance live again) when it serves weights, of
        any version (`_usable` decides whether requests may go to it). Any answer makes
        it loadable."""
        with self._lock:
            loads = instance.loads
        answered, answer = _healthz(f"{instance.url}/healthz", min(5.0, self.timeout_s))
        with self._lock:
            instance.last_probe = time.monotonic()
            self._lock.notify_all()
            if instance.loads != loads:
                # A load it acknowledged meanwhile is newer than this answer (a 503 taken
                # while its first load built the engine would put it out of `live()`).
                return instance.healthy
            instance.answers = answered
            if isinstance(answer, dict) and "policy_version" in answer:
                # Also from a 503: a server restarted at its URL with no weights (its
                # store read failed) serves none, and only a catch-up, which goes to
                # the instances behind, brings it up before the next publication.
                instance.server_id = answer.get("server_id")
                instance.policy_version = answer["policy_version"]
            if not (isinstance(answer, dict) and answer.get("ok")):
                # A live instance behind the current version (the ones probed while
                # healthy) that stopped serving gets no generate requests nor broadcasts.
                instance.healthy = False
                return False
            instance.healthy = True
            return True

    def _probe_loop(self) -> None:
        """Probe each instance that is down, or live but behind the current version, once
        per `probe_every_s`, until the client is closed."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                waiting = [i for i in self.instances if not self._usable(i)]
                due = [i for i in waiting if now - i.last_probe >= self.probe_every_s]
                if not due:
                    timeout = self.probe_every_s  # woken early by mark_down, a load, close
                    if waiting:
                        timeout = min(i.last_probe for i in waiting) + self.probe_every_s - now
                    self._lock.wait(timeout=max(0.01, timeout))
                    continue
            for instance in due:
                if self._closed:
                    return
                self.probe(instance)

    def _acquire(self, deadline: float) -> Instance:
        with self._lock:
            while True:
                if self._closed:
                    raise ClientClosed("the rollout client was closed")
                usable = [i for i in self.instances if self._usable(i)]
                if usable:
                    chosen = min(usable, key=lambda i: i.in_flight)
                    chosen.in_flight += 1
                    return chosen
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    serving = (
                        ""
                        if self._current is None
                        else f" with the weights of version {self._current} or newer"
                    )
                    raise NoInstanceError(
                        f"no rollout instance answered{serving} for {self.deadline_s:.0f} s "
                        f"({', '.join(i.url for i in self.instances)}){self._failures()}"
                    )
                # A probe that brings one back, a load, a failure and close all notify.
                self._lock.wait(timeout=min(remaining, self.probe_every_s))

    def _release(self, instance: Instance) -> None:
        with self._lock:
            instance.in_flight -= 1

    # ---------------------------------------------------------------- requests
    def generate(self, request: GenerateRequest) -> Generated:
        """One request, answered exactly once; re-issued while instances fail, until the
        deadline or until the client is closed (ClientClosed)."""
        deadline = time.monotonic() + self.deadline_s
        body = request.to_json()
        while True:
            instance = self._acquire(deadline)
            with self._lock:
                loads = instance.loads
            try:
                answer = http_json(f"{instance.url}/generate", body, self.timeout_s, self.token)
            except RequestFailed as error:
                self.mark_down(instance, str(error))
                with self._lock:
                    if time.monotonic() >= deadline:
                        # Checked at every failure, not only when none is usable: with
                        # several instances, each probed back while another times out,
                        # a request no instance can answer went round them forever.
                        raise NoInstanceError(
                            f"no rollout instance answered the request for "
                            f"{self.deadline_s:.0f} s{self._failures()}"
                        ) from None
                    self.reissued += 1
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
                if instance.loads == loads:  # else its newer load's version stands
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
        """POST /weights to one instance; False (and the instance marked down) on failure.
        A version it acknowledged becomes the one every instance must serve for requests,
        and the instance is live: it answered, with weights."""
        try:
            answer = http_json(f"{instance.url}/weights", request.to_json(), timeout, self.token)
        except RequestFailed as error:
            self.mark_down(instance, str(error))
            return False
        with self._lock:
            version = answer["policy_version"]
            instance.policy_version = version
            instance.loads += 1
            instance.healthy = instance.answers = True
            if self._current is None or version > self._current:
                self._current = version
            self._lock.notify_all()
        return True

    def wait_reachable(
        self,
        timeout_s: float,
        log: Callable[[str], None] | None = None,
        stopping: Callable[[], bool] = never,
    ) -> None:
        """Block until every instance's server answers /healthz at all (503 too: it may
        have no weights yet); fail naming the first one that does not. StopWaiting when
        `stopping()` turns true (SIGTERM: a deleted job's rollout pods may never come)."""
        deadline = time.monotonic() + timeout_s
        for index, instance in enumerate(self.instances):
            told = False
            while not _healthz(f"{instance.url}/healthz", 5.0)[0]:
                if stopping():
                    raise StopWaiting(f"stopping while waiting for rollout instance {index}")
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

    def wait_ready(self, timeout_s: float, stopping: Callable[[], bool] = never) -> None:
        """Block until every instance answers /healthz (weights loaded); StopWaiting when
        `stopping()` turns true."""
        deadline = time.monotonic() + timeout_s
        for instance in self.instances:
            instance.healthy = False
            while not self.probe(instance):
                if stopping():
                    raise StopWaiting(f"stopping while waiting for {instance.url} to be ready")
                if time.monotonic() > deadline:
                    raise NoInstanceError(
                        f"{instance.url} did not become ready in {timeout_s:.0f} s"
                    )
                liveness.beat("waiting for the rollout instances' weights")  # bounded
                time.sleep(0.1)

    def close(self) -> None:
        """Stop: queued requests are cancelled, and those in flight end at their next
        attempt (ClientClosed) rather than retrying stopped servers until the deadline;
        the threads are not waited for (one may be in a request to a live server)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
