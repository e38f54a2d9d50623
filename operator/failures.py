"""The failure policy: what went wrong with a pod, and what to do about it. Pure functions.

Kinds (seen as → response):

- OOMKilled: container terminated with reason OOMKilled → recreate the pod, with backoff.
- Evicted: pod Failed with reason Evicted → recreate the pod, with backoff.
- Preempted: DisruptionTarget PreemptionByScheduler, reason Preempting, or Kueue's
  TerminationTarget (its workload stopped) → recreate, backoff.
- NodeLost: phase Unknown, reason NodeLost/NodeShutdown, taint-manager deletion →
  recreate, with backoff.
- Rejected: the kubelet refused the pod before any container ran (phase Failed with a
  pod-level reason and no container exit: UnexpectedAdmissionError after a device
  plugin restart, OutOfnvidia.com/gpu, a node affinity no longer met) → recreate, with
  backoff, its message kept; counted (a node that keeps refusing would otherwise have
  the pod recreated forever).
- RendezvousTimeout: a rendezvous / NCCL / gloo timeout in the termination message →
  restart the whole trainer gang from the latest healthy checkpoint, with backoff; while
  another trainer of the gang still runs, first wait briefly for its verdict, which may
  be the cause (responses.py, PEER_VERDICT_WAIT_SECONDS).
- Stalled: a trainer's verdict says `stalled` (it made no progress for
  stallTimeoutSeconds, so its liveness probe failed and the kubelet killed it; a kubelet
  reports such a kill only as exit code 137 or 143, reason Error) → restart the whole
  trainer gang from the latest healthy checkpoint, with backoff.
- Error: any other non-zero exit → recreate the pod, with backoff (a trainer restarts
  its gang, after the same brief wait for its peers' verdicts as RendezvousTimeout).
- InvalidConfig: exit code 2 (trainer/exit_codes.py) → fail the job: permanent.
- Collapsed: exit code 3 (the trainer's stability guard ended the run; it rolls back in
  process itself) → fail the job. A guard that paused the run and /status
  health=collapsed are reconcile.py's (suspend; a condition and an Event).
- ImagePull: ErrImagePull/ImagePullBackOff → wait (the kubelet retries) with a warning,
  fail after schedulingTimeout; InvalidImageName → fail at once.
- ConfigError: CreateContainerConfigError (e.g. a missing Secret) → wait with a warning,
  fail after schedulingTimeout.

A retryable failure of a trainer pod restarts the whole trainer gang (reconcile.py): its
other ranks cannot go on without it. Restarts are counted per failure inside a sliding
window (restartPolicy.windowMinutes); one more than maxRestarts fails the job. The n-th
restart in the window waits backoffSeconds × 2^(n-1), capped at MAX_BACKOFF_SECONDS.
A disruption (the cluster took the pod: Preempted, NodeLost, an Eviction API eviction
such as a drain) is not counted unless restartPolicy.countDisruptions says so, as
Kubernetes Jobs' podFailurePolicy recommends for DisruptionTarget; it waits
backoffSeconds. A kubelet's eviction for node pressure is counted: the pod may be its
cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from rlft.operator.observe import KUEUE_STOP, PodView
from rlft.trainer.exit_codes import ExitCode

MAX_BACKOFF_SECONDS = 3600.0

OOM = "OOMKilled"
EVICTED = "Evicted"
PREEMPTED = "Preempted"
NODE_LOST = "NodeLost"
RENDEZVOUS = "RendezvousTimeout"
STALLED = "Stalled"
ERROR = "Error"
INVALID_CONFIG = "InvalidConfig"
COLLAPSED = "Collapsed"
IMAGE_PULL = "ImagePull"
CONFIG_ERROR = "ConfigError"
REJECTED = "Rejected"
KINDS = (
    OOM,
    EVICTED,
    PREEMPTED,
    NODE_LOST,
    RENDEZVOUS,
    STALLED,
    ERROR,
    INVALID_CONFIG,
    COLLAPSED,
    IMAGE_PULL,
    CONFIG_ERROR,
    REJECTED,
)

# What a wedged collective or a failed rendezvous prints (torch elastic, c10d, NCCL, gloo).
# DistStoreError: the store's waits that time out because a peer never came ("Timed out
# after 600 seconds waiting for clients. 1/2 clients joined.", a store-based barrier).
_RENDEZVOUS = re.compile(
    r"RendezvousTimeoutError|RendezvousClosedError|RendezvousConnectionError|"
    r"DistNetworkError|DistStoreError|connectFullMesh|"
    r"Watchdog caught collective operation timeout|"
    r"NCCL[^\n]*(timeout|timed out)|ProcessGroupNCCL[^\n]*Timeout|"
    r"Timed out waiting for[^\n]*(clients|store)|Socket Timeout",
    re.IGNORECASE,
)
_PREEMPTION = {"PreemptionByScheduler", "PreemptionByKubeScheduler"}
_NODE_LOSS = {"DeletionByTaintManager", "DeletionByPodGC"}
_IMAGE_WAIT = {"ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "RegistryUnavailable"}
_CONFIG_WAIT = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class Failure:
    """A classified pod failure."""

    kind: str
    pod: str
    uid: str
    role: str
    exit_code: int | None = None
    message: str = ""
    permanent: bool = False
    group: bool = False
    """The whole trainer gang must restart (not only this pod)."""
    disruption: bool = False
    """The cluster took the pod (preempted, drained, its node lost): by default not
    counted against restartPolicy."""


def classify(pod: PodView) -> Failure | None:
    """The failure a terminated pod shows, or None if it did not fail (still pending or
    running, or finished with exit code 0). Waiting states are `waiting_problem`'s."""

    verdict = pod.verdict
    # torchrun's agent exits 1 whatever its worker returned: the worker's own verdict,
    # when it wrote one, carries the trainer's exit code. Log text never goes further.
    exit_code = verdict.exit_code if verdict is not None else pod.exit_code

    def failure(kind: str, **kw: object) -> Failure:
        return Failure(
            kind=kind,
            pod=pod.name,
            uid=pod.uid,
            role=pod.role,
            exit_code=exit_code,
            message=verdict.message if verdict is not None else "",
            **kw,
        )

    if pod.phase == "Succeeded" and pod.role == "trainer":
        return None  # the job's success (or a stop, which update_phase judges)
    if pod.phase in ("Pending", "Running") and pod.exit_code is None and not pod.disruption:
        return None
    if pod.on_lost_node:
        # Its status is stale: nobody runs it any more.
        return failure(NODE_LOST, disruption=True)
    if pod.phase == "Running" and pod.exit_code is None:
        return None  # a disruption announced, not happened yet: the pod is still up
    kind = disruption_kind(pod.disruption)
    if kind is not None:
        return failure(kind, disruption=True)
    if pod.reason == "Evicted":  # the kubelet's, for node pressure: counted
        return failure(EVICTED)
    if pod.reason in ("Preempting", "Preempted"):
        return failure(PREEMPTED, disruption=True)
    if pod.phase == "Unknown" or pod.reason in ("NodeLost", "NodeShutdown", "Terminated"):
        return failure(NODE_LOST, disruption=True)
    if pod.terminated_reason == "OOMKilled":
        return failure(OOM)
    if pod.phase == "Failed" and pod.reason and pod.exit_code is None and verdict is None:
        # The kubelet's admission refused it: it never ran. Its message is the only word.
        return Failure(
            kind=REJECTED,
            pod=pod.name,
            uid=pod.uid,
            role=pod.role,
            message=f"{pod.reason}: {pod.status_message}".rstrip(": "),
        )
    if verdict is not None and verdict.stalled and pod.role == "trainer":
        # Its own words, written before its liveness probe failed: the kubelet's kill
        # (exit 137 or 143, reason Error) says nothing of why.
        return failure(STALLED, group=True)
    if exit_code == ExitCode.INVALID_CONFIG:
        return failure(INVALID_CONFIG, permanent=True)
    if exit_code == ExitCode.COLLAPSED and pod.role == "trainer":
        return failure(COLLAPSED)
    stopped = verdict is not None and verdict.stopped  # its process may exit non-zero
    if exit_code == 0 and (pod.phase != "Failed" or stopped) and pod.role == "trainer":
        return None
    if _RENDEZVOUS.search(pod.message):
        return failure(RENDEZVOUS, group=pod.role == "trainer")
    if pod.phase in ("Failed", "Succeeded") or pod.exit_code is not None:
        # A rollout server must never exit. One the cluster took exits 0 on its SIGTERM
        # (Succeeded): that was told apart above, as a disruption, like any other pod's.
        return failure(ERROR)
    return None


def disruption_kind(reason: str) -> str | None:
    """The failure kind of a DisruptionTarget (or Kueue TerminationTarget) reason; None
    for one that is not the cluster's doing (TerminationByKubelet: node pressure)."""
    if reason == "EvictionByEvictionAPI":
        return EVICTED
    if reason in _PREEMPTION or reason.startswith(f"{KUEUE_STOP}/"):
        return PREEMPTED
    if reason in _NODE_LOSS:
        return NODE_LOST
    return None


@dataclass(frozen=True)
class Waiting:
    """A pod that cannot start (yet): kubelet keeps retrying, the operator warns."""

    kind: str
    pod: str
    message: str
    permanent: bool


def waiting_problem(pod: PodView) -> Waiting | None:
    if pod.phase != "Pending" or not pod.waiting_reason:
        return None
    text = f"{pod.waiting_reason}: {pod.waiting_message}".strip(": ")
    if pod.waiting_reason == "InvalidImageName":
        return Waiting(IMAGE_PULL, pod.name, text, permanent=True)
    if pod.waiting_reason in _IMAGE_WAIT:
        return Waiting(IMAGE_PULL, pod.name, text, permanent=False)
    if pod.waiting_reason in _CONFIG_WAIT:
        return Waiting(CONFIG_ERROR, pod.name, text, permanent=False)
    return None


def in_window(history: list[datetime], now: datetime, window_minutes: float) -> list[datetime]:
    """The restart times that still count."""
    start = now - timedelta(minutes=window_minutes)
    return sorted(t for t in history if t > start)


def backoff_seconds(first: float, restarts_in_window: int) -> float:
    """Delay before the n-th restart in the window (n ≥ 1): first × 2^(n-1), capped."""
    if restarts_in_window < 1 or first <= 0:
        return 0.0
    exponent = min(restarts_in_window - 1, 32)
    return min(first * (2.0**exponent), MAX_BACKOFF_SECONDS)


@dataclass(frozen=True)
class Budget:
    """Outcome of asking for one more restart."""

    allowed: bool
    history: list[datetime]
    """Restart times in the window, including this one when allowed."""
    delay: float


def ask_restart(
    history: list[datetime],
    now: datetime,
    *,
    max_restarts: int,
    window_minutes: float,
    backoff: float,
) -> Budget:
    """May the job restart once more now? Never lets the window hold more than
    max_restarts restarts. No wait is longer than the window's share of one restart
    beyond the budget: doubling from backoffSeconds, the waits alone outlasted the window
    (defaults: 10 s doubled 9 times pass 60 minutes), so a job failing at once after
    every start restarted for ever and never failed."""
    recent = in_window(history, now, window_minutes)
    if len(recent) + 1 > max_restarts:
        return Budget(allowed=False, history=recent, delay=0.0)
    recent = [*recent, now]
    share = window_minutes * 60.0 / (max_restarts + 1)
    return Budget(
        allowed=True, history=recent, delay=min(backoff_seconds(backoff, len(recent)), share)
    )
