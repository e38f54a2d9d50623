"""The trainer's `/status` document (docs/architecture.md, "Contracts"): what the operator polls.

A thread-safe board the loop writes to and the HTTP server reads from. The JSON shape
is the contract with the operator:

    {"step": int, "policyVersion": int, "reward": float | null, "phase": str,
     "health": "ok" | "warning" | "collapsed",
     "lastCheckpoint": {"step", "uri", "time"} | null,
     "lastHealthyCheckpoint": {"step", "uri", "time"} | null,
     "rollbacks": int, "skippedUpdates": int,
     "events": [{"time", "step", "kind", "level", "message"}, ...],   # oldest first
     "podUid": str | null}

`time` values are RFC 3339 UTC strings. `events` keeps the most recent `max_events`.
`podUid` is the serving pod's metadata.uid (`$RLFT_POD_UID`, null outside a pod): the
operator drops a document from another pod than the one it asked, an address reused while
an old pod still serves on it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any, Literal

Phase = Literal[
    "starting", "warm_start", "training", "rolling_back", "paused", "finished", "failed"
]
PHASES: tuple[str, ...] = Phase.__args__  # type: ignore[attr-defined]
HEALTH = ("ok", "warning", "collapsed")
EVENT_LEVELS = ("info", "warning", "critical")
POD_UID_ENV = "RLFT_POD_UID"
"""The pod's metadata.uid, set by the operator from the downward API."""


def rfc3339(timestamp: float) -> str:
    """Seconds since the epoch as an RFC 3339 UTC string (what Kubernetes status uses)."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class StatusBoard:
    """Current state of the trainer, safe to update and read from different threads."""

    def __init__(self, max_events: int = 50, pod_uid: str | None = None):
        if max_events < 1:
            raise ValueError("max_events must be ≥ 1")
        self._pod_uid = pod_uid
        self._lock = threading.Lock()
        self._step = 0
        self._policy_version = 0
        self._reward: float | None = None
        self._phase: str = "starting"
        self._health: str = "ok"
        self._last: dict | None = None
        self._last_healthy: dict | None = None
        self._rollbacks = 0
        self._skipped = 0
        self._events: deque[dict] = deque(maxlen=max_events)

    def progress(self, step: int, policy_version: int, reward: float | None = None) -> None:
        """A finished step; `reward` is its mean reward (None for DPO and SFT steps)."""
        with self._lock:
            self._step, self._policy_version = int(step), int(policy_version)
            self._reward = reward

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        with self._lock:
            self._phase = phase

    def set_health(self, health: str) -> None:
        if health not in HEALTH:
            raise ValueError(f"health {health!r} is not one of {HEALTH}")
        with self._lock:
            self._health = health

    def set_counters(self, *, rollbacks: int, skipped_updates: int) -> None:
        with self._lock:
            self._rollbacks, self._skipped = int(rollbacks), int(skipped_updates)

    def checkpoint(self, step: int, uri: str, when: float, healthy: bool) -> None:
        """A committed checkpoint; a healthy one also becomes lastHealthyCheckpoint."""
        entry = {"step": int(step), "uri": uri, "time": rfc3339(when)}
        with self._lock:
            self._last = entry
            if healthy:
                self._last_healthy = dict(entry)

    def event(
        self,
        kind: str,
        message: str,
        level: str = "info",
        step: int | None = None,
        when: float | None = None,
    ) -> None:
        if level not in EVENT_LEVELS:
            raise ValueError(f"event level {level!r} is not one of {EVENT_LEVELS}")
        with self._lock:
            self._events.append(
                {
                    "time": rfc3339(time.time() if when is None else when),
                    "step": self._step if step is None else int(step),
                    "kind": kind,
                    "level": level,
                    "message": message,
                }
            )

    def snapshot(self) -> dict[str, Any]:
        """The /status document."""
        with self._lock:
            return {
                "step": self._step,
                "policyVersion": self._policy_version,
                "reward": self._reward,
                "phase": self._phase,
                "health": self._health,
                "lastCheckpoint": dict(self._last) if self._last else None,
                "lastHealthyCheckpoint": dict(self._last_healthy) if self._last_healthy else None,
                "rollbacks": self._rollbacks,
                "skippedUpdates": self._skipped,
                "events": [dict(e) for e in self._events],
                "podUid": self._pod_uid,
            }
