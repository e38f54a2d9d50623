"""The weight publisher's loads in flight: at most one per rollout instance, each on a
thread of its own, and the wait for a publication's loads.

A store publication counts once an instance took the version and every other one it was
sent to took it too or had the stragglers' wait: `STRAGGLER_WAIT_FACTOR` × the first
one's time, at least `STRAGGLER_WAIT_FLOOR_S`. A load waits behind the generate call in
the instance's engine, and an engine hung in one still answers /healthz until the stall
limit: such an instance held each publication, and the trainer with it, for the whole
request timeout. A straggler's load goes on in the background. It gets no generate
requests until it serves the current version (the client's rule), and no other load
until that one ends, so a wedged instance holds one connection, not one per step;
versions only grow at the instance, so loads never land out of order. A broadcast waits
for every member: its tensors arrived with the group's send, and one left behind would
cost the group's re-forming and a store copy at the next publication.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from rlft.trainer.rollout.client import Instance, RolloutClient
from rlft.trainer.rollout.protocol import SupersededGangError, WeightsRequest

log = logging.getLogger(__name__)

STRAGGLER_WAIT_FLOOR_S = 10.0
"""Once an instance took a version, the others have at least this long more."""
STRAGGLER_WAIT_FACTOR = 4.0
"""... or this many times the first one's load time, when longer (large models)."""


class InstanceLoads:
    def __init__(
        self,
        client: RolloutClient,
        timeout_s: float,
        superseded: Callable[[SupersededGangError], None],
    ):
        """`superseded`: told when a load found this gang replaced (whoever started it)."""
        self.client, self.timeout_s, self._superseded = client, timeout_s, superseded
        self._lock = threading.Lock()
        self._loading: dict[str, Future[bool]] = {}
        """Instance URL → its load in flight."""

    def idle(self, instances: list[Instance]) -> list[Instance]:
        """Those of `instances` with no load in flight."""
        with self._lock:
            return [i for i in instances if i.url not in self._loading]

    def start(self, instance: Instance, request: WeightsRequest) -> Future[bool]:
        """POST `request` to `instance` on a daemon thread: an executor's threads are
        joined at exit, and one waiting on a wedged instance would hold the trainer's exit
        for the request timeout."""
        load: Future[bool] = Future()

        def run() -> None:
            try:
                load.set_result(self.client.load_weights(instance, request, self.timeout_s))
            except BaseException as error:
                load.set_exception(error)

        with self._lock:
            self._loading[instance.url] = load
        load.add_done_callback(lambda _: self._ended(instance.url, load))
        try:
            threading.Thread(target=run, name="weight-load", daemon=True).start()
        except BaseException:
            with self._lock:
                self._loading.pop(instance.url, None)
            raise
        return load

    def _ended(self, url: str, load: Future[bool]) -> None:
        with self._lock:
            if self._loading.get(url) is load:
                del self._loading[url]
        error = load.exception()
        if isinstance(error, SupersededGangError):
            self._superseded(error)
        elif error is not None:  # raised to its publication, if still awaited; else only here
            log.warning("a weight load at %s failed: %s: %s", url, type(error).__name__, error)

    def wait_for_one(self, instances: list[Instance], timeout: float) -> None:
        """Until one of `instances`' loads in flight ends (at once if none is)."""
        with self._lock:
            loads = [self._loading[i.url] for i in instances if i.url in self._loading]
        if loads:
            wait(loads, timeout=timeout, return_when=FIRST_COMPLETED)

    def awaited(
        self, version: int, loads: list[Future[bool]], started: float, stragglers: bool = True
    ) -> bool:
        """Wait until every load ended, or (`stragglers`) one succeeded and the others had
        the stragglers' wait; raise their errors (a SupersededGangError as it is), or that
        none took `version`. Whether every instance took it."""
        pending, until = set(loads), None
        while pending:
            timeout = None if until is None else max(0.0, until - time.monotonic())
            done, pending = wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:
                break
            for load in done:
                if load.exception() is not None:
                    raise load.exception()
                if load.result() and until is None and stragglers:
                    first = time.monotonic() - started
                    until = time.monotonic() + max(
                        STRAGGLER_WAIT_FLOOR_S, STRAGGLER_WAIT_FACTOR * first
                    )
        if not any(load.done() and load.result() for load in loads):
            raise RuntimeError(
                f"no rollout instance accepted weights version {version}{self.client.failures()}"
            )
        if pending:
            log.warning(
                "weights of version %d: published without %d instance(s) still loading it "
                "%.0f s after the first took it; they get no requests until they serve it",
                version,
                len(pending),
                time.monotonic() - started,
            )
        return not pending and all(load.result() for load in loads)
