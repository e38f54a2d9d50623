"""How the operator answers a failed or vanished pod (one reconcile's rules, mixed into
reconcile.py's `_Run`): fail the job, restart the trainer gang or one pod within the
restart budget, force-delete a pod whose node is gone. Pure, like reconcile.py."""

from __future__ import annotations

from datetime import datetime, timedelta

from rlft.operator import failures as P
from rlft.operator import names as N
from rlft.operator.decision import Decision, Event
from rlft.operator.observe import PodView
from rlft.operator.status import FailureRecord, parse_time, rfc3339, set_condition
from rlft.operator.status import RLFineTuneStatus as Status
from rlft.trainer.config import RLFineTuneSpec

"""The pods of a rollout instance that spans nodes (nodesPerInstance > 1)."""
STUCK_TERMINATING_SECONDS = 15.0
"""How long past its grace period a Terminating pod may stay before it is force-deleted."""
PEER_VERDICT_WAIT_SECONDS = 15.0
"""How long a trainer's lost rendezvous or plain error waits for the gang's other trainers
to end: when one rank fails (a bad data file, exit 2), its agent closes the rendezvous and
the other agents end (a rendezvous error, or their workers killed mid-start), sometimes
reported first. Judged alone, that restarted the gang (counted) instead of failing the
job with the rank's own verdict."""
AWAITING_KINDS = (P.RENDEZVOUS, P.ERROR)
"""Failures that may be a peer's consequence; the other kinds are causes of their own."""


def gang_uid(gang_entry: str) -> str:
    """The pod uid of a `status.gangPods` entry (`name/uid`)."""
    return gang_entry.rpartition("/")[2]


def completed(pod: PodView) -> bool:
    """Only rank 0's verdict says the job is complete; another rank exiting 0 is not."""
    return pod.verdict is not None and pod.verdict.completed and pod.verdict.exit_code == 0


def ended_cleanly(pod: PodView) -> bool:
    """The rank's process ended without failing: exit 0, or stopped (SIGTERM, a peer's
    stop) in a multi-pod gang, whose ranks then exit 1 on purpose so that torchrun's agent
    does not wait for a peer that never comes (cli/training.py): their verdict says exit 0,
    stopped, and classify finds no failure in it."""
    if pod.phase == "Succeeded":
        return True
    verdict = pod.verdict
    stopped = verdict is not None and verdict.stopped and not verdict.exit_code
    return pod.phase == "Failed" and stopped


def paused(pod: PodView) -> bool:
    """The trainer's guard paused the run after a collapse (exit 0, collapsed)."""
    return pod.verdict is not None and pod.verdict.collapsed and pod.verdict.exit_code == 0


class FailureResponses:
    """The failure rules of one reconcile; `_Run` provides the state below."""

    st: Status
    d: Decision
    spec: RLFineTuneSpec
    now: datetime
    pods: dict[str, PodView]
    handled: set[str]
    deleted: set[str]
    group_restart: bool
    awaiting_verdicts: tuple[str, ...]
    """Running trainers whose verdicts a failed peer waits for (without_awaited_verdicts)."""

    def event(self, kind: str, reason: str, message: str) -> None:
        self.d.events.append(Event(kind, reason, message))

    def delete(self, pod: PodView) -> None:
        # Gone by the operator's hand: no loss.
        self.st.gang_pods = [e for e in self.st.gang_pods if gang_uid(e) != pod.uid]
        if pod.name not in self.deleted and not pod.deleting:
            self.deleted.add(pod.name)
            self.d.delete_pods.append(pod.name)

    def requeue(self, seconds: float) -> None:
        seconds = max(seconds, 0.05)
        if self.d.requeue_after is None or seconds < self.d.requeue_after:
            self.d.requeue_after = seconds

    def fail(self, reason: str, message: str, failure: P.Failure | None = None) -> None:
        self.st.phase = "Failed"
        self.st.message = message
        self.st.next_restart_at = None
        self.st.last_failure = FailureRecord(
            reason=reason,
            pod=failure.pod if failure else "",
            time=rfc3339(self.now),
            exit_code=failure.exit_code if failure else None,
            message=(failure.message if failure else "")[-1024:],
            action="fail the job",
        )
        set_condition(self.st, "Ready", "False", reason, message, self.now)
        set_condition(self.st, "Progressing", "False", "Failed", message, self.now)
        self.event("Warning", "Failed", message)

    def handle_failures(self) -> None:
        failures = []
        for pod in sorted(self.pods.values(), key=lambda p: p.name):
            # A pod being deleted is ours to judge only when the cluster says why (a
            # preemption, an eviction: DisruptionTarget), once its container has ended.
            if pod.uid in self.handled or (pod.deleting and not pod.disruption):
                continue
            failure = P.classify(pod)
            if failure is not None:
                failures.append(failure)
        failures = self.without_awaited_verdicts(failures)
        if failures and self.run_ended_by_rank_0():
            # Rank 0 finished the job, or its guard paused it: a peer or a rollout server
            # failing meanwhile (in its teardown) is not a failure of the run; the phase
            # follows rank 0.
            self.handled.update(f.uid for f in failures)
            return
        # The first failure judged decides a gang's fate (a gang restart marks the rest
        # handled), so the gravest goes first: a permanent error or the guard's verdict
        # is not retried because a peer's broken connection happened to sort first.
        for failure in sorted(failures, key=lambda f: (not f.permanent, f.kind != P.COLLAPSED)):
            if failure.uid in self.handled:
                continue
            self.handled.add(failure.uid)
            self.respond(failure)
            if self.st.phase == "Failed" or self.d.set_suspend:
                return

    def without_awaited_verdicts(self, failures: list[P.Failure]) -> list[P.Failure]:
        """The failures to judge now: a trainer's lost rendezvous or plain error waits
        (up to PEER_VERDICT_WAIT_SECONDS from its end) while another trainer of its gang
        still runs, for that one's verdict may be the cause, judged first when it comes."""
        running = [
            p.name for p in self.pods.values()
            if p.role == N.ROLE_TRAINER and p.running and p.exit_code is None
            and p.uid not in self.handled
        ]  # fmt: skip
        if not running or self.gang_unplaced():
            return failures  # no peer left to end, or a gang that never met
        if any(f.role == N.ROLE_TRAINER and f.kind not in AWAITING_KINDS for f in failures):
            return failures  # a cause to judge already
        waits = {  # every trainer failure here is of AWAITING_KINDS
            f.uid: left
            for f in failures
            if f.role == N.ROLE_TRAINER and (left := self.verdict_wait(f)) is not None
        }
        if not waits:
            return failures
        self.requeue(min(waits.values()))
        self.awaiting_verdicts = tuple(sorted(running))
        return [f for f in failures if f.uid not in waits]

    def verdict_wait(self, failure: P.Failure) -> float | None:
        """Seconds `failure` may still wait for its peers' verdicts; None to judge it now
        (waited long enough, no end time, or a node clock too far ahead to trust)."""
        pod = self.pods.get(failure.pod)
        ended = parse_time(pod.finished_at) if pod is not None else None
        if ended is None:
            return None
        left = PEER_VERDICT_WAIT_SECONDS - (self.now - ended).total_seconds()
        return left if 0 < left <= 2 * PEER_VERDICT_WAIT_SECONDS else None

    def run_ended_by_rank_0(self) -> bool:
        """A trainer of this gang (not judged yet) exited 0 saying the run is complete, or
        (not being deleted) that its guard paused it after a collapse. A completed pod
        being deleted (a drain right after it finished) still finished the job."""
        return any(
            p.role == N.ROLE_TRAINER and p.phase == "Succeeded" and p.uid not in self.handled
            and (completed(p) or (paused(p) and not p.deleting))
            for p in self.pods.values()
        )  # fmt: skip

    def respond(self, f: P.Failure) -> None:
        st = self.st
        what = f"{f.kind} of pod {f.pod}" + (f" (exit code {f.exit_code})" if f.exit_code else "")
        if f.permanent:
            self.fail(f.kind, f"{what}: permanent error, not restarted", f)
            return
        if f.kind == P.COLLAPSED:
            # The trainer owns the response to a collapse (it rolls back in process, per
            # spec.stability); exiting 3 means its policy ended the run.
            why = f": {f.message}" if f.message else ""
            self.fail(P.COLLAPSED, f"{what}: the trainer's stability guard ended the run{why}", f)
            return
        if f.kind == P.RENDEZVOUS and f.role == N.ROLE_TRAINER and self.gang_unplaced():
            # A gang that could not meet because one of its pods has no node yet is
            # waiting for capacity, not failing: it costs no restart budget.
            self.event(
                "Normal",
                "Waiting",
                f"{what}: a trainer pod is not scheduled yet, so the gang could not meet; "
                "restarting its rendezvous (not counted against restartPolicy)",
            )
            self.record(f, "restart the trainer gang, waiting for capacity")
            st.phase, st.message = "Restarting", "waiting for the trainer gang to be placed"
            self.restart_gang()
            return
        policy = self.spec.restart_policy
        history = [t for t in (parse_time(x) for x in st.restart_history) if t is not None]
        if f.disruption and not policy.count_disruptions:
            budget = P.Budget(
                allowed=True,
                history=P.in_window(history, self.now, policy.window_minutes),
                delay=policy.backoff_seconds,
            )
            counted = "a disruption, not counted against restartPolicy"
        else:
            budget = P.ask_restart(
                history,
                self.now,
                max_restarts=policy.max_restarts,
                window_minutes=policy.window_minutes,
                backoff=policy.backoff_seconds,
            )
            counted = f"restart {len(budget.history)} of {policy.max_restarts} in the window"
        if not budget.allowed:
            limit = self.spec.restart_policy.max_restarts
            window = self.spec.restart_policy.window_minutes
            self.fail(
                "TooManyRestarts",
                f"{what}: {len(budget.history)} restarts in the last {window:g} min, "
                f"maxRestarts is {limit}",
                f,
            )
            return
        st.restart_history = [rfc3339(t) for t in budget.history]
        st.restarts += 1
        next_at = self.now + timedelta(seconds=budget.delay)
        current = parse_time(st.next_restart_at)
        if current is None or next_at > current:
            st.next_restart_at = rfc3339(next_at)
        # A trainer is one rank of a gang whose other ranks cannot go on without it (the
        # rendezvous lives on trainer-0; torchrun restarts nothing): restart them all.
        gang = f.group or f.role == N.ROLE_TRAINER
        # A Ray head and its workers are one rollout instance: vLLM spans them, and none
        # serves without the others (a worker's Ray node gone breaks the head's engine, a
        # head gone leaves its workers on a dead cluster): restart them together, once.
        instance = not gang and f.role in N.RAY_ROLES and f.pod in self.pods
        scope = (
            "the trainer gang"
            if gang
            else f"rollout instance {self.pods[f.pod].index} (its Ray head and workers)"
            if instance
            else f"pod {f.pod}"
        )
        action = f"restart {scope} in {budget.delay:g} s ({counted})"
        self.record(f, action)
        self.event("Warning", "Restarting", f"{what}: {action}")
        if f.role == N.ROLE_TRAINER:
            st.phase = "Restarting"
            st.message = f"restarting after {f.kind}"
        if gang:
            self.restart_gang()
        elif instance:
            self.restart_instance(self.pods[f.pod].index)
        elif f.pod in self.pods:
            self.delete(self.pods[f.pod])

    def record(self, f: P.Failure, action: str) -> None:
        self.st.last_failure = FailureRecord(
            reason=f.kind,
            pod=f.pod,
            time=rfc3339(self.now),
            exit_code=f.exit_code,
            message=f.message[-1024:],
            action=action,
        )

    def hidden_oom(self) -> None:
        """A rank OOM-killed is often judged second: its peers' broken collectives end
        them first, and the gang restart that follows marks it handled. Its OOMKilled is
        still the cause the user must act on, so it becomes the last failure (the
        restart is counted once already) with one Event."""
        last = self.st.last_failure
        if last is not None and last.reason == P.OOM:
            # Named already. Two ranks OOM-killed together (they use memory alike) were
            # named in turn, each reconcile the other one, with a Warning each time.
            return
        seen = {p.uid: p for p in self.observed.oom_killed} | {p.uid: p for p in self.pods.values()}
        for pod in sorted(seen.values(), key=lambda p: p.name):
            if pod.uid not in self.handled or pod.terminated_reason != P.OOM:
                continue
            message = (
                f"pod {pod.name} was OOM-killed at its memory limit while the gang restarted "
                f"after {last.reason if last else 'a failure'} of {last.pod if last else '?'}; "
                "raise the role's resources.limits.memory if it recurs"
            )
            action = last.action if last is not None else "restart the trainer gang"
            self.record(
                P.Failure(P.OOM, pod.name, pod.uid, pod.role, pod.exit_code, message), action
            )
            self.event("Warning", P.OOM, message)
            return

    def gang_unplaced(self) -> bool:
        """Fewer than replicas.min trainer pods of the current gang have a node (the rest
        are Pending, or not created yet: their slot still held by a terminating pod of an
        earlier gang), so the gang could not have met. A pod of the current gang being
        deleted (its node lost) was placed: that gang met, and losing it is a failure."""
        current = {gang_uid(entry) for entry in self.st.gang_pods}
        placed = [
            p for p in self.pods.values()
            if p.role == N.ROLE_TRAINER and p.scheduled
            and (not p.deleting or p.uid in current)
        ]  # fmt: skip
        # A pod of the current gang that is gone already (force-deleted, collected, or
        # while no operator watched) ran in it: it was placed, and the gang had met.
        vanished = current - {p.uid for p in self.pods.values()}
        return len(placed) + len(vanished) < self.spec.trainer.replicas.min

    def restart_gang(self) -> None:
        self.group_restart = True
        self.st.gang_pods = []
        self.st.gang_attempt += 1  # a rendezvous of its own (see the status field)
        for pod in self.pods.values():
            if pod.role == N.ROLE_TRAINER:
                self.handled.add(pod.uid)  # their SIGTERM exits are not new failures
                self.delete(pod)

    def restart_instance(self, index: int) -> None:
        """Delete every pod of multi-node rollout instance `index`; their exits meanwhile
        are this restart's, not new failures (each was counted as one)."""
        for pod in self.pods.values():
            if pod.role in N.RAY_ROLES and pod.index == index:
                self.handled.add(pod.uid)
                self.delete(pod)

    def force_stuck(self) -> None:
        """A pod deleted gracefully that is still there well past its grace period has no
        kubelet to finish the deletion (its node is lost): force-delete it, so that its
        slot, whose name is fixed, can be filled again."""
        said = set(self.st.force_deleted) & {p.uid for p in self.pods.values()}
        for pod in sorted(self.pods.values(), key=lambda p: p.name):
            if pod.on_lost_node:
                # Its node was silent for nodeLostSeconds already: waiting out the grace
                # too would only keep the slot empty (no kubelet runs the shutdown).
                self._force_delete(pod, said, "was evicted from a node that stopped reporting")
                continue
            deadline = parse_time(pod.deletion_deadline) if pod.deleting else None
            if deadline is None:
                continue
            late = (self.now - deadline).total_seconds()
            if late < STUCK_TERMINATING_SECONDS:
                self.requeue(STUCK_TERMINATING_SECONDS - late)
                continue
            self._force_delete(
                pod,
                said,
                f"still Terminating {late:.0f} s after its grace period ended (its node "
                "stopped reporting?)",
            )
        self.st.force_deleted = sorted(said)

    def _force_delete(self, pod: PodView, said: set[str], why: str) -> None:
        """Force-delete `pod` (again, if a finalizer held it); its Event only the first time."""
        self.d.force_delete_pods.append(pod.name)
        if pod.uid not in said:
            said.add(pod.uid)
            self.event(
                "Warning",
                "ForceDeleted",
                f"pod {pod.name} {why}: force-deleted so it can be replaced",
            )

    def lost_trainers(self) -> None:
        """A trainer pod that vanished (deleted, evicted, its node gone) while the rest of
        its gang lives: the survivors' ranks are broken, so the gang restarts."""
        st = self.st
        if self.group_restart or self.run_ended_by_rank_0():
            return  # a peer gone after rank 0 finished (its node lost, collected) broke nothing
        trainers = {p.uid: p for p in self.pods.values() if p.role == N.ROLE_TRAINER}
        gone = [entry for entry in st.gang_pods if gang_uid(entry) not in trainers]
        st.gang_pods = [entry for entry in st.gang_pods if gang_uid(entry) in trainers]
        known = {gang_uid(entry) for entry in st.gang_pods}
        # Pods the operator deleted (a restarted gang's, still seen running for a while)
        # are handled: their going is no loss.
        st.gang_pods += [
            f"{p.name}/{u}" for u, p in trainers.items()
            if p.running and u not in known and u not in self.handled
        ]  # fmt: skip
        seen = dict(entry.split("/", 1) for entry in st.gang_disruptions)
        seen |= {u: p.disruption for u, p in trainers.items() if p.disruption}
        gang = {gang_uid(entry) for entry in st.gang_pods}
        st.gang_disruptions = [f"{u}/{reason}" for u, reason in seen.items() if u in gang]
        if not gone or st.phase not in ("Running", "Restarting"):
            return
        name, _, uid = gone[0].rpartition("/")
        # Seen being taken by the cluster before it vanished (its end unseen): that.
        kind = P.disruption_kind(seen.get(uid, ""))
        self.respond(
            P.Failure(
                kind=kind or P.ERROR,
                pod=name,
                uid=uid,
                role=N.ROLE_TRAINER,
                message=f"trainer pod {name} of the running gang is gone ("
                + (f"{seen[uid]}" if kind else "deleted, evicted or its node lost")
                + ")",
                group=True,
                disruption=kind is not None,
            )
        )

    def pause_unfinished(self) -> bool:
        """A trainer that paused the run (collapsed, exit 0) was judged, yet its pod is
        still here and not being deleted: only the suspend deletes it (a user may resume
        while it is still going), so the spec.suspend patch that was to
        follow the status write did not land (the operator died between the two, or the
        patch failed). Ask again; True when so (nothing else is done this round, or the
        paused run would be restarted)."""
        asked = any(
            p.role == N.ROLE_TRAINER and p.uid in self.handled and p.phase == "Succeeded"
            and not p.deleting and paused(p)
            for p in self.pods.values()
        )  # fmt: skip
        if asked:
            self.d.set_suspend = True
        return asked

    def stopped_early(self, exited: list[PodView]) -> None:
        """Every trainer exited 0 but rank 0 did not report completion (they stopped
        after an emergency checkpoint, say): a retryable failure of the gang."""
        fresh = [p for p in exited if p.uid not in self.handled]
        if not fresh:
            return
        self.handled.update(p.uid for p in fresh)
        first = fresh[0]
        pause = next((p for p in fresh if paused(p)), None)
        if pause is not None:  # the trainer's guard paused the run: the job is suspended
            message = f"the trainer paused after a collapse: {pause.verdict.message}"
            self.d.set_suspend = True
            self.record(
                P.Failure(P.COLLAPSED, pause.name, pause.uid, N.ROLE_TRAINER, 0, message),
                "suspend the job",
            )
            self.event("Warning", "Collapsed", f"{message}; suspending the job")
            return
        self.respond(
            P.Failure(
                kind=P.ERROR,
                pod=first.name,
                uid=first.uid,
                role=N.ROLE_TRAINER,
                exit_code=0,
                message="the trainers exited before rank 0 reported the job complete",
                group=True,
            )
        )
