"""Whether a trainer rank is making progress: the fact behind its pod's liveness probe.

A rank is *live* while its main thread made progress within
`spec.trainer.stallTimeoutSeconds`, and *stalled* once it did not (a hung collective, a
hung weight sync, a deadlock). It is judged from its first loop step on (`begin`): what
comes before (torch's import, the process group, loading the model and a checkpoint) is
the pod's startup probe's to allow, on `STARTED_PATH`, and a worker torchrun restarted
in place is left alone until it trains again. What counts as progress is a `beat()` of
the main thread:

- a step starting, its update done, the step finished (checkpoint included);
- each micro-batch of the backward pass;
- rank 0 waiting for rollouts: each time more completion tokens arrived (a hung weight
  sync stops them, so it is not progress);
- each evaluation batch; each attempt of a retried storage call (bounded by its
  deadline); a checkpoint still in flight, within its own retry deadline;
- rank 0 waiting for the rollout instances to answer, within that wait's deadline;
- the milestones of starting up (process group joined, model built, checkpoint loaded).

Beats from other threads are ignored: a background upload or the rollout pipeline can be
busy while the loop itself is hung, and only the loop's progress is the run's.

A rank other than 0 that waits in a broadcast from rank 0, or in a barrier, is waiting
for rank 0's own work (generating, evaluating, publishing the outputs): it is not judged
meanwhile (`waiting`). Rank 0 is never waiting, so it judges that work itself, and when
rank 0 is killed the waiting rank's collective breaks. Whichever rank really hangs is
never in a wait, so its own probe fires.

Cheap by design: a beat is a clock read and two assignments. The liveness endpoint
(`liveness_server.py`) and a watch thread read the state; the watch writes the rank's
`stalled` verdict into the termination message the moment the rank stalls (once it is
killed it can write nothing), and removes it if the rank recovers.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rlft.trainer import termination
from rlft.trainer.exit_codes import ExitCode

PATH = "/livez"
"""The endpoint a trainer pod's liveness probe asks: 200 unless stalled."""
STARTED_PATH = "/started"
"""The endpoint its startup probe asks: 200 once the rank's loop has begun."""
PORT_ENV = "RLFT_LIVENESS_PORT"
"""Set by the operator on trainer pods: local rank 0 of each pod serves PATH there."""


@dataclass(frozen=True)
class State:
    alive: bool
    idle_s: float
    """Seconds since the main thread's last progress."""
    last: str
    """What that progress was (the loop's own words: a step, a phase; never data)."""
    waiting: str | None = None
    """What the rank waits for, when it waits for rank 0's own work."""
    started: bool = True
    """Its loop has begun (before that it is not judged)."""

    def document(self, stall_timeout_s: float) -> dict[str, object]:
        """The endpoint's JSON body."""
        return {
            "alive": self.alive,
            "started": self.started,
            "idleSeconds": round(self.idle_s, 1),
            "stallTimeoutSeconds": stall_timeout_s,
            "last": self.last,
            "waiting": self.waiting,
        }


class Liveness:
    """The progress of one rank. `stall_timeout_s` 0: never stalled (the feature is off)."""

    def __init__(
        self,
        stall_timeout_s: float,
        rank: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
        owner: threading.Thread | None = None,
        environ: dict[str, str] | None = None,
    ):
        if stall_timeout_s < 0:
            raise ValueError("stall_timeout_s must be ≥ 0")
        self.stall_timeout_s = stall_timeout_s
        self.rank = rank
        self._clock = clock
        self._owner = owner or threading.main_thread()
        self._environ = environ
        self._last = clock()
        self._what = "starting"
        self._waiting: list[str] = []
        self._started = False
        self._ended = False
        self._stalled = False
        self._stall_message = ""
        self._lock = threading.Lock()

    # ------------------------------------------------------------- the main thread
    def beat(self, what: str) -> None:
        """Progress of the main thread (calls from other threads are ignored)."""
        if threading.current_thread() is not self._owner:
            return
        self._last = self._clock()
        self._what = what
        if self._stalled:
            self._recovered()

    def begin(self) -> None:
        """The loop's first step is next: from now on the rank is judged."""
        self._started = True
        self.beat("the loop began")

    def end(self) -> None:
        """The rank is about to write its final verdict: nothing is judged any more (a
        peer slow to reach the last barrier must not turn a finished rank's verdict into
        a stall). Under the lock: a stall `check` is declaring completes first, so the
        final verdict, written after, carries it (`marked`)."""
        with self._lock:
            self._ended = True

    @contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """The main thread waits for rank 0's own work (see the module's docstring)."""
        if threading.current_thread() is not self._owner:
            yield
            return
        self._waiting.append(what)
        try:
            yield
        finally:
            self._waiting.pop()
        self.beat(f"{what}: done")  # not when it raised: a broken collective is no progress

    # ----------------------------------------------------------------- readers
    def state(self) -> State:
        idle = max(0.0, self._clock() - self._last)
        top = self._waiting[-1:]  # a slice: the main thread may pop meanwhile
        waiting = top[0] if top else None
        started = self._started
        judged = self.stall_timeout_s > 0 and started and not self._ended and waiting is None
        alive = not judged or idle <= self.stall_timeout_s
        return State(alive, idle, self._what, waiting, started)

    @property
    def stalled(self) -> bool:
        """Whether the rank was declared stalled and has not made progress since."""
        return self._stalled

    def check(self) -> State:
        """The state, declaring the rank stalled the first time it is not alive: its
        verdict then says so, for the operator to read once the kubelet killed it."""
        with self._lock:
            state = self.state()
            if not state.alive and not self._stalled:
                verdict = self.stalled_verdict(state)
                termination.write(verdict, self._environ)
                self._stall_message = verdict.message
                self._stalled = True  # after the write: `stalled` means the verdict is there
            return state

    def stalled_verdict(self, state: State) -> termination.Verdict:
        message = (
            f"stalled: rank {self.rank} made no progress for {state.idle_s:.0f} s "
            f"(stallTimeoutSeconds {self.stall_timeout_s:g}); last progress: {state.last}"
        )
        return termination.Verdict(ExitCode.FAILURE, message, self.rank, stalled=True)

    def marked(self, verdict: termination.Verdict) -> termination.Verdict:
        """`verdict` as this process reports it: still `stalled` after a stall it never
        recovered from (its collective broke when a peer was killed, say), its message
        the stall's first and then its own: the stall is the cause, the error follows."""
        if not self._stalled:
            return verdict
        message = self._stall_message + (f"; then {verdict.message}" if verdict.message else "")
        return dataclasses.replace(verdict, stalled=True, message=message)

    def _recovered(self) -> None:
        with self._lock:
            if self._stalled:
                self._stalled = False
                termination.clear(self.rank, self._environ)


_current = Liveness(0)
"""The process's liveness; off (stall timeout 0) until `install` configures it."""


def install(liveness: Liveness) -> Liveness:
    global _current
    _current = liveness
    return liveness


def current() -> Liveness:
    return _current


def report(verdict: termination.Verdict) -> None:
    """Write the pod's verdict, marked with what liveness knows (a declared stall)."""
    termination.write(current().marked(verdict))


def report_unless_written(verdict: termination.Verdict) -> None:
    """`report`, unless this process wrote its verdict already (from a thread ending it)."""
    termination.write_unless_written(current().marked(verdict))


def beat(what: str) -> None:
    """Progress of the main thread, for the process's liveness."""
    _current.beat(what)


def waiting(what: str):
    """The main thread waits for rank 0's own work (not judged meanwhile)."""
    return _current.waiting(what)


def begin() -> None:
    """The loop's first step is next: the rank is judged from now on."""
    _current.begin()
