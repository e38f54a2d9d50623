"""Trainer rank 0's weight publisher: after each optimizer step it snapshots the policy
(on the trainer thread, so later updates cannot leak in) and ships it to every live
instance on a background thread, so the trainer does not wait for instances busy with a
generate request (their weight load waits for it: updates are atomic per request).

Only the newest pending version is shipped: if the trainer is two versions ahead of a
slow publication, the older one is skipped. `wait(version)` blocks until that version is
published (the pipeline's start rule needs this): an instance took it, and every other
one it was sent to took it too or had the stragglers' wait (`loads.py`; an instance with
a load still in flight is sent none).

A failed shipment (the object store down, every instance refusing the load) is retried
with backoff until `timeout_s`, or until a newer version is pending, which replaces it:
an outage of the store stalls generation for its length instead of ending the run.

Between publications the thread brings instances that fell behind up to date: one whose
load of the newest version failed (a transient store error) while another took it, or
one with no weights yet, is sent that version's store copy again (`_catch_up`). Without
it, it took no requests (it serves an older version) and got nothing until the next
publication, which needs samples: generation stalled once the up-to-date ones died.
An instance whose catch-up fails is tried again after a wait that doubles, up to
`catch_up_backoff_max_s`, and at once when a newer version is published.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
from safetensors.torch import save

from rlft.trainer.rollout.client import Instance, RolloutClient
from rlft.trainer.rollout.loads import InstanceLoads
from rlft.trainer.rollout.protocol import SupersededGangError, WeightsRequest
from rlft.trainer.storage.retry import backoff_delays
from rlft.trainer.telemetry.liveness_server import pod_address
from rlft.trainer.weights.store import WeightStore, config_json, serialize, unique_tensors

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightPublisher:
    def __init__(
        self,
        client: RolloutClient,
        store: WeightStore,
        mode: str = "store",
        timeout_s: float = 600.0,
        host: str | None = None,
        catch_up_every_s: float = 1.0,
        catch_up_backoff_max_s: float = 60.0,
        gang: int | None = None,
    ):
        if mode not in ("store", "broadcast"):
            raise ValueError(f"publication mode {mode!r}: use store or broadcast")
        self.client, self.store, self.mode = client, store, mode
        self.gang = gang
        """This trainer's gang attempt, sent with each load: an instance that took weights
        from a newer gang refuses them (SupersededGangError ends the publication)."""
        # The broadcast group's address, which rollout pods connect to.
        self.timeout_s, self.host = timeout_s, host or pod_address()
        self._cond = threading.Condition()
        self._pending: tuple[int, object, str] | None = None
        self._acked = -1
        self._error: BaseException | None = None
        self._closed = False
        self._group = None
        self._group_name = ""
        self._members: tuple[tuple[str, str | None], ...] = ()
        """(URL, server id) of the group's instances."""
        self._latest: tuple[int, str] | None = None
        """(version, URI) of the newest acknowledged version with a store copy: what an
        instance behind is sent."""
        self._written: tuple[int, str] | None = None
        """(version, URI) of the last store copy written, acknowledged or not."""
        self.catch_up_every_s = catch_up_every_s
        self.catch_up_backoff_max_s = catch_up_backoff_max_s
        self._loads = InstanceLoads(client, timeout_s, self._superseded)
        self._held: dict[str, tuple[float, float]] = {}  # absent: (0, 0), not held
        """Instance URL → (when its next catch-up may be tried, the wait before it): one
        whose catch-up keeps failing (a 401, a store it cannot read) is tried less and
        less often, not every `catch_up_every_s` with a warning each time, for ever."""
        self.last_publish_s = 0.0
        """Seconds from snapshot to the last publication counting as done (the stragglers'
        wait included, when one was left loading)."""
        self.published = 0
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ trainer side
    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Snapshot `model` as `version` and ship it in the background."""
        if self.mode == "store" or self.published == 0:  # the first version builds engines
            snapshot: object = serialize(model)
        else:
            snapshot = {k: v.clone() for k, v in unique_tensors(model.state_dict()).items()}
        with self._cond:
            self._raise_error()
            self._pending = (version, snapshot, config_json(model))
            self._cond.notify_all()

    def publish_now(self, model: torch.nn.Module, version: int) -> None:
        self.publish(model, version)
        self.wait(version)

    def wait(self, version: int, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._acked < version:
                self._raise_error()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"weights of version {version} not acknowledged in time")
                self._cond.wait(timeout=remaining if remaining is not None else 1.0)
            self._raise_error()

    def mark_acked(self, version: int) -> None:
        """Every instance already serves `version` (it started from the store)."""
        with self._cond:
            self._acked = max(self._acked, version)
            self._cond.notify_all()

    @property
    def acked(self) -> int:
        with self._cond:
            return self._acked

    def _raise_error(self) -> None:
        if isinstance(self._error, SupersededGangError):
            raise self._error  # as it is: this gang must stop, not retry
        if self._error is not None:
            raise RuntimeError(f"weight publication failed: {self._error}") from self._error

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ---------------------------------------------------------- background side
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as error:  # surfaced to the trainer on its next call
            # Whatever ended the thread: a catch-up's error (no thread to start, say)
            # ended it silently, and the trainer waited for an ack forever.
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._woken, self.catch_up_every_s)
                if self._closed or self._error is not None:
                    return  # a background load's error ends the thread as its own would
                pending, self._pending = self._pending, None
            if pending is None:
                self._catch_up()
                continue
            version, snapshot, config = pending
            started = time.perf_counter()
            shipped, uri = self._ship_retrying(version, snapshot, config)
            if not shipped:
                continue  # a newer version replaced it
            with self._cond:
                self.last_publish_s = time.perf_counter() - started
                self.published += 1
                self._acked = max(self._acked, version)
                if uri is not None:
                    self._latest = (version, uri)
                    self._held.clear()  # a new version: each behind instance tries again
                self._cond.notify_all()

    def _woken(self) -> bool:
        return self._pending is not None or self._closed or self._error is not None

    def _catch_up(self) -> None:
        """Send the newest acknowledged version's store copy to the instances that answer
        but serve an older version or none, and have no load in flight. Not waited for: a
        wedged instance would hold up the next publication. A load in flight per instance
        at most, and versions only grow at the instance, so none lands out of order."""
        if self._latest is None:
            return
        version, uri = self._latest
        now = time.monotonic()
        idle = self._loads.idle(self.client.behind(version))
        behind = [i for i in idle if self._hold(i.url)[0] <= now]
        request = self._request(version, uri=uri)
        for instance in behind:
            self._loads.start(instance, request).add_done_callback(
                lambda load, url=instance.url: self._caught_up(url, version, load)
            )

    def _caught_up(self, url: str, version: int, load: Future[bool]) -> None:
        """Hold `url` back from catch-ups a while after a failed one (its error is logged
        where every load's is, `InstanceLoads`)."""
        error = load.exception()
        with self._cond:
            if self._latest is not None and self._latest[0] > version:
                return  # a newer version cleared the holds: this result is of no account
            if error is None and load.result():
                self._held.pop(url, None)
                return
            delay = self._hold(url)[1] * 2 or self.catch_up_every_s
            delay = min(delay, self.catch_up_backoff_max_s)
            self._held[url] = (time.monotonic() + delay, delay)

    def _superseded(self, error: SupersededGangError) -> None:
        with self._cond:
            if self._error is None:
                self._error = error  # this gang must stop: the trainer hears of it next call
            self._cond.notify_all()

    def _raise_superseded(self) -> None:
        """A load on another thread found this gang replaced: send and write nothing more
        (a store copy would put this gang's weights where the new gang's are)."""
        with self._cond:
            if isinstance(self._error, SupersededGangError):
                raise self._error

    def _hold(self, url: str) -> tuple[float, float]:
        with self._cond:
            return self._held.get(url, (0.0, 0.0))

    def _ship_retrying(self, version: int, snapshot, config: str) -> tuple[bool, str | None]:
        """Ship `version`, retried until `timeout_s`: (False if a newer version became
        pending first (it is shipped instead), the URI of its store copy if it has one)."""
        deadline = time.monotonic() + self.timeout_s
        delays = backoff_delays(0.5, 10.0, jitter=0.2)
        attempt = 0
        while True:
            attempt += 1
            self._raise_superseded()
            try:
                return True, self._ship(version, snapshot, config)
            except SupersededGangError:
                raise  # a newer gang took the instances over: no retry would pass
            except Exception as error:
                delay = next(delays)
                if time.monotonic() + delay > deadline:
                    raise
                log.warning(
                    "weights of version %d: publication failed (attempt %d): %s; retrying in %.1fs",
                    version,
                    attempt,
                    error,
                    delay,
                )
            with self._cond:
                if self._cond.wait_for(self._woken, delay):
                    self._raise_superseded()
                    return False, None

    def _ship(self, version: int, snapshot, config: str) -> str | None:
        """Ship `version`; the URI of its store copy, if one was written."""
        if isinstance(snapshot, bytes):
            uri = self._stored(version, lambda: snapshot, config)
            self._post_all(self._request(version, uri=uri))
            return uri
        try:
            return self._broadcast(version, snapshot, config)
        except SupersededGangError:
            raise
        except Exception as error:  # a member died mid-broadcast: fall back to the store
            log.warning(
                "weights of version %d: broadcast failed (%s); by the store", version, error
            )
            self._group, self._members = None, ()
            uri = self._stored(version, lambda: save(snapshot), config)
            self._post_all(self._request(version, uri=uri))
            return uri

    def _request(
        self, version: int, uri: str | None = None, broadcast: dict | None = None
    ) -> WeightsRequest:
        """A load of `version`, stamped with this trainer's gang (every load must be)."""
        return WeightsRequest(version=version, uri=uri, broadcast=broadcast, gang=self.gang)

    def _stored(self, version: int, weights: Callable[[], bytes], config: str) -> str:
        """The URI of `version`'s store copy, written unless an earlier attempt of this
        publication wrote it (each retry uploaded the whole model again)."""
        if self._written is not None and self._written[0] == version:
            return self._written[1]
        self._raise_superseded()
        uri = self.store.write(version, weights(), config)
        self._written = (version, uri)
        return uri

    def _post_all(self, request: WeightsRequest) -> None:
        # Every instance that answers, weights or not (a fresh one answers 503, and only
        # a load brings it up). One whose last load failed is marked down until the next
        # probe: ask now rather than count a version no instance loaded as published.
        targets = self._loads.idle(self.client.loadable())
        if not targets and self.client.loadable():
            # Each still loads an earlier version (a catch-up, a straggler): its load ends
            # within the timeout, then this one goes.
            self._loads.wait_for_one(self.client.loadable(), self.timeout_s)
            targets = self._loads.idle(self.client.loadable())
        if not targets:
            for instance in self.client.instances:
                self.client.probe(instance)
            targets = self._loads.idle(self.client.loadable())
        if not targets:
            busy = "still loading an earlier one" if self.client.loadable() else "none answers"
            raise RuntimeError(
                f"no live rollout instance to load weights version {request.version} "
                f"({busy}){self.client.failures()}"
            )
        started = time.monotonic()
        loads = [self._loads.start(i, request) for i in targets]
        self._loads.awaited(request.version, loads, started)

    def _members_now(self) -> list[Instance]:
        """The live instances, each asked which server process answers at its URL: one
        restarted in its pod since the group formed is not in it (a broadcast over the
        old group would wait for it until the group's timeout)."""
        live = self._loads.idle(self.client.live())
        with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            list(pool.map(self.client.probe, live))
        return self._loads.idle(self.client.live())

    def _broadcast(self, version: int, state: dict[str, torch.Tensor], config: str) -> str | None:
        """Send over the group; (re)form it when the live instances changed. A store copy
        is written, once the members took the version, whenever the group is re-formed,
        for instances that catch up later (a restarted one reads the store's newest:
        without it, the first version's), and when a member fell out (`_catch_up` sends it
        that copy); its URI is returned."""
        from rlft.trainer.weights.broadcast import BroadcastGroup, GroupAddress

        live = self._members_now()
        if not live:  # a group of the trainer alone "sends" to nobody, and succeeds
            raise RuntimeError(
                f"no live rollout instance to send weights version {version}"
                f"{self.client.failures()}"
            )
        members = tuple((i.url, i.server_id) for i in live)
        if members != self._members:
            self._group = None
        forming = self._group is None
        if self._group is None:
            # Named: a new group may get the last one's port, and a member at the same
            # rank in both took it for the old (dead) group and never joined the new one.
            self._group_name = uuid.uuid4().hex
            address = GroupAddress(self.host, free_port(self.host), len(live) + 1)
        else:
            address = self._group.address
        requests = [
            self._request(
                version,
                broadcast={
                    "address": address.address,
                    "rank": rank,
                    "world_size": address.world_size,
                    "timeout_s": min(self.timeout_s, 60.0),
                    "group": self._group_name,
                },
            )
            for rank in range(1, len(live) + 1)
        ]
        started = time.monotonic()
        loads = [self._loads.start(i, r) for i, r in zip(live, requests, strict=True)]
        try:
            if self._group is None:
                self._group = BroadcastGroup(address, 0, min(self.timeout_s, 60.0), self.host)
                self._members = members
            self._group.send(version, state)
        except Exception:
            # Members that refused this gang (409, at once) never joined: the group timed
            # out waiting for them. Ended here, not by falling back to the store, which
            # would write this replaced gang's weights where the new gang's are.
            wait(loads, timeout=5.0)
            for load in loads:
                if load.done() and isinstance(load.exception(), SupersededGangError):
                    raise load.exception() from None
            raise
        # Every member: its tensors arrived, it waits only for the generate call in its
        # engine, and one left behind would cost a re-formed group and a store copy.
        everyone = self._loads.awaited(version, loads, started, stragglers=False)
        if not everyone:  # someone fell out or still loads: re-form the group next time
            self._group, self._members = None, ()
        if forming or not everyone:  # written once the members took it, not before:
            # a gang refused by them (a newer one replaced it) writes nothing there.
            return self._stored(version, lambda: save(state), config)
        return None
