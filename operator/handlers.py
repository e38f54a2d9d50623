"""kopf handlers: thin glue between the API server and the pure state machine.

Every event that may matter (the RLFineTune changed, one of its pods changed, a timer, a
backoff expiring) "kicks" the job. A kick runs one reconcile per job at a time and folds
kicks that arrive meanwhile into one more run, so bursts cost one reconcile. A reconcile:

1. reads the RLFineTune fresh (read-your-writes for the bookkeeping in its status),
2. lists its pods, Services and ConfigMaps (by label: kopf's watch caches keep objects
   deleted during a watch gap),
3. polls the trainer's /status (running trainer pods, rank 0 answers),
4. asks `reconcile.reconcile` what to do,
5. writes the status first (with a resourceVersion precondition: what was counted stays
   counted even if the next step fails), then deletes, re-renders and creates children,
   posts one Event per decision and updates the metrics;
6. a write the API server refuses (quota, PodSecurity, 422) stops that round of writes
   and is recorded in the status, with a backoff, by `creation.after_writes`; other API
   errors end the reconcile and it is retried after a few seconds.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from rlft.operator import crd
from rlft.operator import creation as C
from rlft.operator import failures as P
from rlft.operator import manifests as M
from rlft.operator import names as N
from rlft.operator.decision import Decision, Observed, invalid_spec
from rlft.operator.kube import ApiError, Connection, Kube, fetch_json
from rlft.operator.metrics import OperatorMetrics
from rlft.operator.observe import PodView, TrainerReport, pod_view, trainer_report
from rlft.operator.pod_spec import spec_problems
from rlft.operator.reconcile import reconcile
from rlft.operator.status import RLFineTuneStatus, read_status
from rlft.trainer.addresses import ALL as ALL_ADDRESSES
from rlft.trainer.addresses import http_url
from rlft.trainer.config import JobFileError, parse_job

log = logging.getLogger("rlft.operator")
MANAGED = {N.LABEL_MANAGED_BY: N.MANAGED_BY}
Key = tuple[str, str]


@dataclass
class Options:
    """Operator-wide settings (from the command line)."""

    settings: M.Settings = field(default_factory=M.Settings)
    poll_seconds: float = 15.0
    """How often every job is reconciled even without events (and /status polled)."""
    priority: int = 0
    peering_lifetime: int = 60
    metrics_host: str = ALL_ADDRESSES
    metrics_port: int = 9090
    identity: str = "rlft-operator"


@dataclass
class _JobState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dirty: bool = False
    timer: asyncio.TimerHandle | None = None
    served: bool = False
    """kopf serves the job on this replica (its `_serve` daemon runs): false while kopf
    pauses for a replica of higher priority, which leads the job meanwhile."""
    reconciled_at: float = -float("inf")
    """When its last reconcile ended (time.monotonic)."""
    oom_killed: dict[str, tuple[PodView, float]] = field(default_factory=dict)
    """uid → (the pod's view, when seen): pods seen OOM-killed, until the planner names
    the OOM or OOM_MEMORY_SECONDS pass (see Observed.oom_killed)."""


OOM_MEMORY_SECONDS = 120.0
TIMER_SECONDS = 15.0
"""kopf's timer for every job: the longest a job goes unreconciled with --poll-seconds 15."""


class Runtime:
    """What the handlers share: options, the API client, per-job kick state, metrics."""

    def __init__(self) -> None:
        self.options = Options()
        self.kube: Kube | None = None
        self.jobs: dict[Key, _JobState] = {}
        self.metrics = OperatorMetrics()
        self.namespaces: list[str] = []
        self.heartbeat: asyncio.Task | None = None


RUNTIME = Runtime()


def configure(options: Options, namespaces: list[str]) -> None:
    RUNTIME.options = options
    RUNTIME.namespaces = list(namespaces)


# ------------------------------------------------------------------------- startup


@kopf.on.startup()
async def _startup(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    options = RUNTIME.options
    # Handler progress in annotations, not in status: the status schema is the CRD's.
    settings.persistence.finalizer = "rlft.dev/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="rlft.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="rlft.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # Events are posted per decision, explicitly
    settings.peering.priority = options.priority
    settings.peering.lifetime = options.peering_lifetime
    settings.peering.mandatory = False
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    port = RUNTIME.metrics.serve(options.metrics_host, options.metrics_port)
    if RUNTIME.heartbeat is None or RUNTIME.heartbeat.done():  # once, kopf retrying or not
        RUNTIME.heartbeat = asyncio.get_running_loop().create_task(RUNTIME.metrics.heartbeat())
    logger.info(f"metrics on {http_url(options.metrics_host, port, '/metrics')} (and /livez)")
    _login(settings=settings, logger=logger)
    if not settings.peering.standalone and RUNTIME.kube is not None:
        await _ensure_peering(settings, logger)


async def _ensure_peering(settings: kopf.OperatorSettings, logger: logging.Logger) -> None:
    """Create the peering object kopf's leader election uses (it must exist)."""
    kube = _kube()
    name = settings.peering.name
    if settings.peering.clusterwide:
        paths = ["/apis/kopf.dev/v1/clusterkopfpeerings"]
        kind = "ClusterKopfPeering"
    else:
        paths = [f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings" for ns in RUNTIME.namespaces]
        kind = "KopfPeering"
    for path in paths:
        try:
            await kube.post(
                path, {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": name}}
            )
        except ApiError as error:
            if error.status == 404:
                logger.warning(
                    f"no {kind} resource: apply crds/kopf-peering.yaml for leader election"
                )
            elif error.status != 409:
                raise


def _credentials(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _fresh_connection(settings: Any) -> Connection | None:
    """The credentials as they are now (a rotated service-account token is re-read)."""
    info = _credentials(settings=settings)
    return None if info is None else Connection.from_kopf(info)


@kopf.on.login()
def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf calls this at start and again when its own calls get a 401."""
    info = _credentials(**kwargs)
    if info is None:
        return None
    if RUNTIME.kube is None:
        relogin = functools.partial(_fresh_connection, kwargs["settings"])
        RUNTIME.kube = Kube(Connection.from_kopf(info), relogin=relogin)
    else:
        RUNTIME.kube.reconnect(Connection.from_kopf(info))
    return info


@kopf.on.cleanup()
async def _cleanup(**_: Any) -> None:
    for state in RUNTIME.jobs.values():
        if state.timer is not None:
            state.timer.cancel()
    if RUNTIME.kube is not None:
        await RUNTIME.kube.close()
    RUNTIME.metrics.close()


# ------------------------------------------------------------------------ triggers


@kopf.on.event(crd.GROUP, crd.VERSION, crd.PLURAL)
async def _job_event(
    event: dict[str, Any], namespace: str, name: str, meta: Any, **kwargs: Any
) -> None:
    if event.get("type") == "DELETED":
        _forget((namespace, name))
        return
    if not meta.get("deletionTimestamp"):
        await kick((namespace, name))


@kopf.on.event("pods", labels=MANAGED)
async def _pod_event(namespace: str, labels: dict[str, str], body: Any, **kwargs: Any) -> None:
    job = labels.get(N.LABEL_JOB)
    if job:
        view = pod_view(dict(body))
        if view is not None and view.terminated_reason == P.OOM:
            state = RUNTIME.jobs.setdefault((namespace, job), _JobState())
            state.oom_killed[view.uid] = (view, time.monotonic())
        await kick((namespace, job))


@kopf.timer(crd.GROUP, crd.VERSION, crd.PLURAL, interval=TIMER_SECONDS, initial_delay=1.0)
async def _poll(namespace: str, name: str, meta: Any, **kwargs: Any) -> None:
    """Every job now and then, events or none. The timer's interval is fixed when this
    module is imported; a job reconciled within --poll-seconds is left alone, so a longer
    --poll-seconds does space the reconciles and /status polls out."""
    if meta.get("deletionTimestamp"):
        return
    state = RUNTIME.jobs.get((namespace, name))
    if state is not None and time.monotonic() - state.reconciled_at < RUNTIME.options.poll_seconds:
        return
    await kick((namespace, name))


@kopf.daemon(crd.GROUP, crd.VERSION, crd.PLURAL, cancellation_timeout=5.0)
async def _serve(namespace: str, name: str, stopped: Any, **_: Any) -> None:
    """Runs while this replica serves the job: kopf stops it when it pauses (another
    replica leads) or the job goes. The job's own wake-ups (`_schedule`) kick only
    meanwhile: they went on through a pause, reconciling beside the leader from what
    they saw, and deleted gangs the leader had restarted since."""
    key = (namespace, name)
    RUNTIME.jobs.setdefault(key, _JobState()).served = True
    try:
        await stopped.wait()
    finally:
        # Counted only while served: a paused replica's last count, summed with the
        # leader's, would show every job twice.
        RUNTIME.metrics.set_phase(key, None)
        state = RUNTIME.jobs.get(key)
        if state is not None:
            state.served = False
            if state.timer is not None:
                state.timer.cancel()
                state.timer = None


@kopf.on.delete(crd.GROUP, crd.VERSION, crd.PLURAL)
async def _finalize(body: Any, namespace: str, name: str, spec: Any, **kwargs: Any) -> None:
    """The finalizer: remove the job's pods, Services and ConfigMap (owner references would
    too, but not before the CR is gone), keep its checkpoints, say so in an Event."""
    _forget((namespace, name))
    kube = _kube()
    selector = N.children_selector(name)
    removed = 0
    for kind in ("Pod", "Service", "ConfigMap"):
        for child in await kube.list_names(kind, namespace, selector):
            removed += await kube.delete(kind, namespace, child)
            RUNTIME.metrics.children.labels(kind=kind, action="delete").inc()
    uri = (spec.get("checkpoint") or {}).get("uri") or "(the trainer's default location)"
    try:
        await kube.post_event(
            dict(body),
            "Normal",
            "Deleted",
            f"removed {removed} children; checkpoints kept at {uri}",
            RUNTIME.options.identity,
        )
    except ApiError as error:
        # A namespace being deleted refuses new Events (403): raising would keep the
        # finalizer, retried for ever, and the namespace Terminating for good.
        log.warning(f"{namespace}/{name}: could not post the Deleted Event: {error}")


# ------------------------------------------------------------------------- the loop


def _forget(key: Key) -> None:
    state = RUNTIME.jobs.pop(key, None)
    if state is not None and state.timer is not None:
        state.timer.cancel()
    RUNTIME.metrics.forget_job(key)


def _kube() -> Kube:
    if RUNTIME.kube is None:
        raise kopf.TemporaryError("not logged in to the API server yet", delay=1)
    return RUNTIME.kube


async def kick(key: Key) -> None:
    """Reconcile the job now; kicks during a run fold into one more run."""
    state = RUNTIME.jobs.setdefault(key, _JobState())
    state.dirty = True
    if state.lock.locked():
        return
    async with state.lock:
        result = ""
        while state.dirty:
            state.dirty = False
            started = time.perf_counter()
            try:
                result = await _reconcile_once(key, state)
            except ApiError as error:
                result = "conflict" if error.status == 409 else "api-error"
                if error.status != 409:
                    log.warning(f"{key[0]}/{key[1]}: {error}")
                _schedule(key, state, 0.5 if error.status == 409 else 5.0)
            except Exception:
                # A bug, not the API server: counted (alertable) and logged with its
                # traceback; the job's timer tries again within 15 s.
                result = "error"
                log.exception(f"{key[0]}/{key[1]}: reconcile failed")
            state.reconciled_at = time.monotonic()
            RUNTIME.metrics.reconciles.labels(result=result).inc()
            RUNTIME.metrics.reconcile_seconds.observe(time.perf_counter() - started)
        if result == "gone" and RUNTIME.jobs.get(key) is state:
            # A deleted job's pods still send events while they terminate (or this
            # replica never saw the job's deletion): their kicks made this state, and
            # nothing else would remove it over the operator's lifetime.
            _forget(key)


def _schedule(key: Key, state: _JobState, delay: float) -> None:
    if state.timer is not None:
        if state.timer.when() <= asyncio.get_running_loop().time() + delay:
            return
        state.timer.cancel()
    loop = asyncio.get_running_loop()
    state.timer = loop.call_later(delay, lambda: asyncio.ensure_future(_wake(key)))


async def _wake(key: Key) -> None:
    state = RUNTIME.jobs.get(key)
    if state is not None:
        state.timer = None
        if state.served:
            await kick(key)


def _recent_ooms(state: _JobState) -> list[PodView]:
    horizon = time.monotonic() - OOM_MEMORY_SECONDS
    state.oom_killed = {u: seen for u, seen in state.oom_killed.items() if seen[1] > horizon}
    return [view for view, _ in state.oom_killed.values()]


async def observe_children(
    namespace: str, job: str
) -> tuple[list[PodView], frozenset[str], dict[str, str | None]]:
    """The job's pods, Service names and ConfigMaps (name → job file) as the API server
    stores them now. Listed at each reconcile, not taken from watch caches: after a watch
    gap (410 Gone) or a pause for another replica, kopf's relist adds and updates what it
    caches but keeps what was deleted meanwhile, and a pod that stayed there filled its
    slot for good (never made again; a ghost Running trainer counted towards the gang)."""
    kube = _kube()
    selector = N.children_selector(job)
    pods, services, config_maps = await asyncio.gather(
        *(kube.list_objects(kind, namespace, selector) for kind in ("Pod", "Service", "ConfigMap"))
    )
    views = [view for view in map(pod_view, pods) if view is not None]
    return (
        views,
        frozenset(s["metadata"]["name"] for s in services),
        # The job file too: the planner re-renders a ConfigMap whose file is not the spec's.
        {c["metadata"]["name"]: (c.get("data") or {}).get("job.yaml") for c in config_maps},
    )


async def poll_trainer(pods: list[PodView], port: int) -> TrainerReport | None:
    """The first running trainer's /status that parses and comes from that pod (rank 0's;
    the other ranks serve none)."""
    for pod in sorted(pods, key=lambda p: p.index):
        if pod.role == N.ROLE_TRAINER and pod.running and pod.pod_ip:
            document = await fetch_json(http_url(pod.pod_ip, port, "/status"))
            report = trainer_report(document, pod.uid)
            if report is not None:
                return report
    return None


async def _reconcile_once(key: Key, state: _JobState) -> str:
    kube = _kube()
    namespace, name = key
    body = await kube.get_job(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return "gone"
    status, dropped = read_status(body.get("status") or {})
    if dropped:
        log.warning(f"{namespace}/{name}: status fields that do not parse were dropped: {dropped}")
    now = datetime.now(UTC)
    document = {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"name": name, "namespace": namespace},
        "spec": body.get("spec"),
    }
    pods, services, config_maps = await observe_children(namespace, name)
    try:
        job = parse_job(document, f"{namespace}/{name}")
        if problems := spec_problems(job):
            raise JobFileError(f"{namespace}/{name}", problems)
    except JobFileError as error:
        suspend = bool((body.get("spec") or {}).get("suspend"))
        decision = invalid_spec(status, error.problems, now, pods, suspend)
    else:
        observed = Observed(
            pods=pods,
            config_maps=frozenset(config_maps),
            services=services,
            report=None
            if status.phase == "Suspended"
            else await poll_trainer(pods, RUNTIME.options.settings.status_port),
            config_data={n: text for n, text in config_maps.items() if text is not None},
            oom_killed=_recent_ooms(state),
        )
        decision = reconcile(job, body, status, observed, now, RUNTIME.options.settings)
        named = decision.status.last_failure
        if named is not None and named.reason == P.OOM:  # said once is enough
            state.oom_killed = {
                uid: seen for uid, seen in state.oom_killed.items() if seen[0].name != named.pod
            }
    # The pods the decision saw, by uid: one created since under a name (another
    # replica's replacement) is not deleted.
    uids = {pod.name: pod.uid for pod in pods}
    retry = await _apply(key, body, status, decision, now, uids)
    poll = RUNTIME.options.poll_seconds
    delay = min(decision.requeue_after or poll, poll, retry or poll)
    _schedule(key, state, delay)
    return "ok"


def _version(written: dict[str, Any] | None, before: str | None) -> str | None:
    return ((written or {}).get("metadata") or {}).get("resourceVersion") or before


async def _apply(
    key: Key,
    body: dict[str, Any],
    old: RLFineTuneStatus,
    d: Decision,
    now: datetime,
    uids: dict[str, str],
) -> float | None:
    """Carry out a decision (pods deleted by the uid it saw them with); returns the seconds
    until a refused write may be retried."""
    kube = _kube()
    namespace, name = key
    version = body["metadata"].get("resourceVersion")
    new = d.status.model_dump(mode="json", by_alias=True)
    if new != old.model_dump(mode="json", by_alias=True) or not body.get("status"):
        version = _version(await kube.patch_job_status(namespace, name, new, version), version)
    metrics = RUNTIME.metrics
    if d.status.restarts > old.restarts:
        metrics.restarts.labels(rlfinetune=f"{namespace}/{name}").inc(
            d.status.restarts - old.restarts
        )
    if d.status.rollbacks > old.rollbacks:
        metrics.rollbacks.labels(rlfinetune=f"{namespace}/{name}").inc(
            d.status.rollbacks - old.rollbacks
        )
    state = RUNTIME.jobs.get(key)
    if state is not None and state.served:
        # Not once `_serve` has ended: a reconcile still writing when this replica paused
        # would count the job again here, for good (nothing reconciles it here after).
        metrics.set_phase(key, d.status.phase)
    # The decision's Events go with its status: the next reconcile starts from that
    # status and says none of them again, so a failure below must not lose them.
    await _post_events(body, [(e.type, e.reason, e.message) for e in d.events])
    if d.set_suspend:
        written = await kube.patch_job(namespace, name, {"spec": {"suspend": True}})
        version = _version(written, version)
    for pod in d.delete_pods:
        if await kube.delete("Pod", namespace, pod, uid=uids.get(pod)):
            metrics.children.labels(kind="Pod", action="delete").inc()
    for pod in d.force_delete_pods:
        if await kube.delete("Pod", namespace, pod, grace_seconds=0, uid=uids.get(pod)):
            metrics.children.labels(kind="Pod", action="force-delete").inc()
    refusal = await _write_children(namespace, d)
    events = []
    generation = body["metadata"].get("generation")
    after = C.after_writes(d.status, refusal, bool(d.create or d.update), generation, now)
    if after is not None:
        status, event = after
        if refusal is not None and refusal.verb == "update":
            status.observed_generation = old.observed_generation  # the edit did not land
        events += [event] if event is not None else []
        try:
            await kube.patch_job_status(
                namespace, name, status.model_dump(mode="json", by_alias=True), version
            )
        except ApiError as error:  # the job changed meanwhile: the next reconcile sees it
            log.warning(f"{namespace}/{name}: could not record the refused write: {error}")
    await _post_events(body, events)
    return C.backoff_seconds(after[0].create_failure.attempts) if refusal and after else None


async def _post_events(body: dict[str, Any], events: list[tuple[str, str, str]]) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    for type_, reason, message in events:
        RUNTIME.metrics.decisions.labels(reason=reason).inc()
        log.info(f"{namespace}/{name}: {reason}: {message}")
        try:
            await _kube().post_event(body, type_, reason, message, RUNTIME.options.identity)
        except ApiError as error:  # an Event is a courtesy; the status already says it
            log.warning(f"{namespace}/{name}: could not post an Event: {error}")


def _drawn(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest to send: the job's token Secret gets its tokens here, at the call,
    so the pure planner never draws one and nothing but the API server ever holds them."""
    if manifest["kind"] != "Secret":
        return manifest
    return M.with_tokens(manifest, secrets.token_urlsafe(32), secrets.token_urlsafe(32))


async def _write_children(namespace: str, d: Decision) -> C.Refusal | None:
    """Re-render, then create, in the decision's order; stop at the first write the API
    server refuses (the rest would mostly be refused alike, and pods must not start
    before their ConfigMap is current). Other errors propagate."""
    kube, metrics = _kube(), RUNTIME.metrics
    writes = [("update", m) for m in d.update] + [("create", m) for m in d.create]
    for verb, manifest in writes:
        kind, child = manifest["kind"], manifest["metadata"]["name"]
        try:
            if verb == "update":
                await kube.patch(kind, namespace, child, {"data": manifest["data"]})
                metrics.children.labels(kind=kind, action="update").inc()
            elif await kube.create(_drawn(manifest)):
                metrics.children.labels(kind=kind, action="create").inc()
        except ApiError as error:
            if error.status not in C.REFUSED_CODES:
                raise
            log.warning(f"{namespace}/{child}: {verb} refused: {error}")
            return C.Refusal(verb, kind, child, error.status, error.message)
    return None
