"""The operator's state machine: (job, status, observed children, trainer report, now) →
(new status, children to create, pods to delete, events). Pure: no I/O, no clock.

Phases:

    (new) → Pending ──replicas.min trainer pods running──→ Running ──rank 0 completed──→ Succeeded
    Running/Pending ──retryable failure──→ Restarting ──gang running again──→ Running
    non-terminal ──spec.suspend──→ Suspended ──spec.suspend=false──→ Pending
    non-terminal ──permanent error, too many restarts, the trainer's guard ended it──→ Failed

A collapse has one owner, the trainer: it rolls back in process (spec.stability). The
operator shows /status health=collapsed as the Healthy condition and an Event, fails the
job when the trainer's guard ended the run (exit 3), and suspends it when the guard paused
it (a verdict with `collapsed`, exit 0).

Invariants the property tests check: a pod name is never created while a pod of that name
exists (names are per slot, so no slot ever has two pods); the restarts inside the window
never exceed maxRestarts (one more fails the job); a known checkpoint reference is never
dropped; nothing is created once the job is Failed, Succeeded or Suspended.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

import yaml

from rlft.operator import creation as C
from rlft.operator import failures as P
from rlft.operator import manifests as M
from rlft.operator import names as N
from rlft.operator import pod_spec
from rlft.operator import spec_changes as S
from rlft.operator.decision import Decision, Observed
from rlft.operator.responses import FailureResponses, completed, ended_cleanly
from rlft.operator.status import (
    MESSAGE_LENGTH,
    TERMINAL_PHASES,
    CheckpointRef,
    condition,
    parse_time,
    rfc3339,
    set_condition,
)
from rlft.operator.status import RLFineTuneStatus as Status
from rlft.trainer.config import JobFileError, RLFineTune, parse_job, read_yaml
from rlft.trainer.termination import Verdict

RESTARTED_WHOLE = (N.ROLE_TRAINER, *N.RAY_ROLES)
"""Roles whose pods restart together (the trainer gang, a multi-node rollout instance)."""

SCHEDULER_REASON_POLL_SECONDS = 2.0
"""After the scheduling timeout, how soon to look again for the scheduler's reason."""
SCHEDULER_REASON_WAIT_SECONDS = 60.0
"""How long past the timeout to keep looking (a scheduler may never give one: pod
events still reconcile the job after that)."""


class _Run(FailureResponses):
    """One reconcile: accumulates the decision while walking through the rules."""

    def __init__(
        self,
        job: RLFineTune,
        body: dict[str, Any],
        status: Status,
        observed: Observed,
        now: datetime,
        settings: M.Settings,
    ):
        self.job, self.body, self.observed, self.now, self.settings = (
            job,
            body,
            observed,
            now,
            settings,
        )
        self.spec = job.spec
        self.st = status.model_copy(deep=True)
        self.d = Decision(status=self.st)
        self.pods = {p.name: p for p in observed.pods}
        self.deleted: set[str] = set()
        self.handled = set(self.st.handled_pods)
        self.group_restart = False
        self.awaiting_verdicts: tuple[str, ...] = ()
        self.cannot_start = False
        self.generation: int | None = body["metadata"].get("generation")
        self.waiting: tuple[str, ...] = ()  # edits that must wait for a suspend
        self.held_update = False  # a ConfigMap to re-render, held by the create backoff

    def resume(self) -> str:
        """The next trainer start's --resume: until the job has a checkpoint of its own,
        its own choice (never, say); then latest-healthy (see checkpointed_once)."""
        return self.st.resume if self.st.resume != "auto" else self.job.spec.checkpoint.resume

    def desired(self, job: RLFineTune | None = None) -> M.Desired:
        return M.desired(
            job or self.job, self.body, self.settings, self.resume(), self.st.gang_attempt
        )

    def running_job(self, desired: M.Desired) -> M.Desired | None:
        """The children of the job file the running pods read (the ConfigMap as it is);
        None when it is unknown or unreadable."""
        texts = [self.observed.config_data.get(name) for name in desired.config_maps]
        if not texts or texts[0] is None:
            return None
        try:
            return self.desired(parse_job(read_yaml(texts[0])))
        except (JobFileError, yaml.YAMLError):
            return None

    def checkpointed_once(self) -> None:
        """Every trainer start after the job's first checkpoint resumes with
        latest-healthy, whatever spec.checkpoint.resume says: `never` is about checkpoints
        that were at the location before the job, and a restart must not abandon the
        job's own. Until then (a gang still waiting, failing in its warm start, a job
        created suspended) each start takes the spec's choice again, so a restart never
        loads another run's checkpoint the spec said not to."""
        own = self.st.last_checkpoint is not None or any(
            p.verdict is not None and p.verdict.last_checkpoint is not None
            for p in self.pods.values()
            if p.role == N.ROLE_TRAINER
        )  # a trainer's termination message names its last one (/status may not have)
        if own:
            self.st.resume = "latest-healthy"

    # ------------------------------------------------------------------- rules
    def mirror_report(self) -> None:
        report = self.observed.report
        if report is None:
            return
        st = self.st
        # A trainer starting (or in its warm start) has not restored its step and policy
        # version yet: its 0s would set the job's back after every restart.
        if report.phase not in ("starting", "warm_start"):
            if report.step is not None:
                st.step = report.step
            if report.policy_version is not None:
                st.policy_version = report.policy_version
        if report.reward is not None:
            st.reward = report.reward
        healthy = report.last_healthy_checkpoint
        if report.last_checkpoint is not None:
            ref = dict(report.last_checkpoint)
            if "healthy" not in ref:
                ref["healthy"] = healthy is not None and healthy["step"] == ref["step"]
            changed = st.last_checkpoint is None or st.last_checkpoint.step != ref["step"]
            st.last_checkpoint = CheckpointRef(**ref)
            message = f"step {ref['step']} at {ref['uri']}"
            set_condition(st, "Checkpointed", "True", "Committed", message, self.now)
            if changed:
                self.event("Normal", "Checkpointed", f"checkpoint committed: {message}")
        if healthy is not None:
            st.last_healthy_checkpoint = CheckpointRef(**{**healthy, "healthy": True})
        level = {
            "ok": ("True", "Ok"),
            "warning": ("True", "Warning"),
            "collapsed": ("False", "Collapsed"),
        }[report.health]
        changed = set_condition(
            st, "Healthy", level[0], level[1], f"trainer health: {report.health}", self.now
        )
        if changed and report.health == "collapsed":  # one owner: the trainer acts on it
            action = self.spec.stability.on_collapse
            self.event(
                "Warning",
                "Collapsed",
                f"trainer /status reports health=collapsed at step {report.step}; the trainer "
                f"responds in process (stability.onCollapse={action})",
            )
        if report.rollbacks is not None:  # the trainer's count, kept in its checkpoints
            st.rollbacks = max(st.rollbacks, report.rollbacks)

    def mirror_verdict(self, verdict: Verdict) -> None:
        """The finished trainer's last step and checkpoint: /status may not have been
        polled since (a short job ends between two polls)."""
        st = self.st
        if verdict.step is not None:
            st.step = verdict.step
        last = verdict.last_checkpoint
        if last is not None and (st.last_checkpoint is None or st.last_checkpoint.step != last):
            st.last_checkpoint = CheckpointRef(step=last, uri=verdict.checkpoint_uri or "")
            message = f"step {last} at {verdict.checkpoint_uri}"
            set_condition(st, "Checkpointed", "True", "Committed", message, self.now)

    def terminal(self) -> None:
        for pod in self.pods.values():
            if pod.active:
                self.delete(pod)  # free the GPUs; finished and failed pods stay for their logs
        self.unscheduled(self.st.phase or "Ended", "the job has ended: no pod of it runs")

    def unscheduled(self, reason: str, message: str) -> None:
        """Scheduled turns False once the job's pods are gone for good or suspended: a
        Failed job showing "2 trainer pods scheduled" read as one that still ran. An
        Unschedulable condition keeps its reason, the more telling one."""
        if any(c.type == "Scheduled" and c.status != "False" for c in self.st.conditions):
            set_condition(self.st, "Scheduled", "False", reason, message, self.now)

    def suspend(self) -> None:
        st = self.st
        if st.phase != "Suspended":
            self.event(
                "Normal",
                "Suspended",
                "spec.suspend is set: pods stop after an emergency checkpoint (SIGTERM)",
            )
        if (st.step or 0) > 0:
            # The gang has trained: SIGTERM makes it write an emergency checkpoint, which
            # its pods, deleted here, may never report.
            st.resume = "latest-healthy"
        st.phase = "Suspended"
        st.message = "suspended; set spec.suspend to false to resume from the latest checkpoint"
        st.next_restart_at = None
        st.waiting_since = None
        for pod in self.pods.values():
            self.delete(pod)
        self.unscheduled("Suspended", "the job is suspended: its pods are deleted")
        set_condition(st, "Ready", "False", "Suspended", "the job is suspended", self.now)
        set_condition(st, "Progressing", "False", "Suspended", "the job is suspended", self.now)
        cm = M.config_map(self.job, self.body, self.settings)
        if cm["metadata"]["name"] in self.observed.config_maps:  # else made on resume
            self.refresh_config({cm["metadata"]["name"]: cm})

    def waiting_problems(self) -> None:
        timeout = self.spec.scheduling.scheduling_timeout_seconds
        for pod in sorted(self.pods.values(), key=lambda p: p.name):
            w = P.waiting_problem(pod)
            if w is None or pod.deleting:
                continue
            # From the pod's placement: waiting for a node is no image pull's time (a
            # registry's first 429 on a node that came after 10 minutes failed the job).
            since = parse_time(pod.scheduled_at) or parse_time(pod.created) or self.now
            waited = (self.now - since).total_seconds()
            if w.permanent or waited >= timeout:
                why = "permanent" if w.permanent else f"for {waited:.0f} s ≥ schedulingTimeout"
                self.fail(w.kind, f"pod {w.pod} cannot start ({why}): {w.message}")
                return
            self.requeue(timeout - waited)
            if self.cannot_start:
                # The condition names one pod: each pod's in turn made every problem look
                # new, and each reconcile posted a Warning per pod.
                continue
            self.cannot_start = True
            before = next((c.reason for c in self.st.conditions if c.type == "Ready"), None)
            set_condition(self.st, "Ready", "False", w.kind, f"pod {w.pod}: {w.message}", self.now)
            if before != w.kind:  # one Event when the problem appears, not one per reconcile
                self.event("Warning", w.kind, f"pod {w.pod} cannot start yet: {w.message}")

    def active_pods(self) -> bool:
        """A pod of the job that reads, or may yet read, its job file (not going away)."""
        return any(p.active and p.name not in self.deleted for p in self.pods.values())

    def refresh_config(self, config_maps: dict[str, dict[str, Any]]) -> None:
        """Re-render each existing ConfigMap whose job file is not the spec's, when no
        active pod reads it or only live fields differ; else the edit waits (spec_changes)."""
        for name, cm in config_maps.items():
            text = self.observed.config_data.get(name)
            change = S.config_change(text, cm["data"]["job.yaml"], self.active_pods())
            self.waiting += change.waiting
            if not change.update:
                continue
            if C.hold_seconds(self.st, self.generation, self.now) is None:
                self.d.update.append(cm)
            else:
                self.held_update = True

    def rescale(self) -> None:
        """spec.trainer.replicas differs from the running gang's `--nnodes`: restart the
        gang with the new one (spec_changes: agents must agree on it). Deliberate, so
        not a failure and not counted against restartPolicy."""
        st, shape = self.st, S.gang_replicas(self.spec)
        trainers = [
            p for p in self.pods.values()
            if p.role == N.ROLE_TRAINER and p.name not in self.deleted and not p.deleting
        ]  # fmt: skip
        if st.gang_replicas is None:  # a status written before this field existed
            st.gang_replicas = shape if trainers else None
        # With an edit waiting for a suspend, replacements are made from the job file the
        # running pods read (ensure_children): a restart now would bring back the same
        # shape, and again each round. The new replicas apply with that edit.
        if st.gang_replicas in (None, shape) or not trainers or self.waiting:
            return
        if self.run_ended_by_rank_0():  # finished or paused: nothing to restart for it
            return
        self.event(
            "Normal",
            "Rescaling",
            f"spec.trainer.replicas changed from {st.gang_replicas} to {shape}: restarting "
            f"the trainer gang with --nnodes={shape} and --resume={self.resume()} "
            "(not counted against restartPolicy)",
        )
        if st.phase == "Running":
            st.phase = "Restarting"
        st.message = f"restarting the trainer gang with replicas {shape}"
        self.restart_gang()

    def refresh_configs(self) -> None:
        """Re-render the ConfigMaps the pods read, or say which edits wait (self.waiting)."""
        desired = self.desired()
        self.refresh_config(
            {n: cm for n, cm in desired.config_maps.items() if n in self.observed.config_maps}
        )

    def ensure_children(self) -> None:
        desired = self.desired()
        if self.waiting:
            # The edit waits for a suspend: new pods (replacements) and the slots are the
            # job's as its running pods read it, not the edit's.
            running = self.running_job(desired)
            if running is not None:
                desired = replace(desired, pods=running.pods, pod_groups=running.pod_groups)
        for pod in self.pods.values():
            if pod.name not in desired.pods:
                self.delete(pod)  # a slot that no longer exists (replicas or instances lowered)
        wait = C.hold_seconds(self.st, self.generation, self.now)
        if wait is not None:  # the API server refused a create: back off (creation.py)
            self.requeue(wait)
            return
        for name, cm in desired.config_maps.items():
            if name not in self.observed.config_maps:
                self.d.create.append(cm)
        for name, svc in desired.services.items():
            if name not in self.observed.services:
                self.d.create.append(svc)
        if self.run_ended_by_rank_0():
            return  # nothing more to run: update_phase ends the job
        missing = [name for name in desired.pods if name not in self.pods]
        hold = parse_time(self.st.next_restart_at)
        if hold is not None and self.now < hold:
            if missing:
                self.requeue((hold - self.now).total_seconds())
            return
        self.st.next_restart_at = None
        if missing:
            # The token Secret and the NetworkPolicy are not watched: sent with each
            # round, kept if they exist. Gang schedulers place pods only with their
            # PodGroup (gang.py).
            self.d.create.extend(desired.guards)
            self.d.create.extend(desired.pod_groups.values())
        tokenless = self.tokenless_trainers()
        for name in missing:
            pod = desired.pods[name]
            if tokenless and pod["metadata"]["labels"][N.LABEL_ROLE] in N.API_SERVERS:
                pod = pod_spec.without_rollout_token(pod)
                self.event("Normal", "NoRolloutToken", f"{name}: {tokenless}")
            self.d.create.append(pod)
        made = [
            desired.pods[name] for name in missing
            if desired.pods[name]["metadata"]["labels"][N.LABEL_ROLE] == N.ROLE_TRAINER
        ]  # fmt: skip
        if made:
            # The shape the pods are made with (the running job file's while an edit
            # waits), not the spec's: the status says what the gang runs.
            self.st.gang_replicas = _nnodes(made[0]) or S.gang_replicas(self.spec)
            if hold is not None:
                # The gang's pods are made once its restart backoff ends: the wait for
                # nodes begins now (a backoff longer than schedulingTimeoutSeconds
                # declared the gang unschedulable the moment its pods were created).
                self.st.waiting_since = rfc3339(self.now)

    def tokenless_trainers(self) -> str:
        """Why a rollout pod made now gets no token ('' when it does): the job's running
        trainers were made by an operator from before tokens and send none (an upgrade
        under a running job). Its next gang restart gives them one; a tokenless server
        takes their requests as it takes any."""
        old = sorted(
            p.name for p in self.pods.values()
            if p.role == N.ROLE_TRAINER and p.active and not p.rollout_token
        )  # fmt: skip
        if not old:
            return ""
        return (
            f"made without the rollout token: trainer pods {', '.join(old)} were made "
            "without one (an operator from before tokens); their requests would be refused"
        )

    def settle(self, rescaling: bool) -> None:
        if self.held_update:
            return  # the re-rendering waits for the create backoff: not applied yet
        found = S.settle(self.st, self.generation, self.waiting, rescaling, self.now)
        if found is not None:
            self.event("Warning", *found)

    def update_phase(self) -> None:
        st, now = self.st, self.now
        replicas = self.spec.trainer.replicas
        live = [p for p in self.pods.values() if p.name not in self.deleted and not p.deleting]
        trainers = [p for p in live if p.role == N.ROLE_TRAINER]
        done = [  # being deleted too: a drain right after the end does not undo it
            p.verdict for p in self.pods.values()
            if p.role == N.ROLE_TRAINER and p.name not in self.deleted
            and p.phase == "Succeeded" and completed(p)
        ]  # fmt: skip
        if done:
            self.mirror_verdict(done[0])
            st.phase = "Succeeded"
            st.message = "training finished"
            st.next_restart_at = None
            self.event("Normal", "Succeeded", f"rank 0 finished the job at step {st.step}")
            set_condition(st, "Progressing", "False", "Finished", "training finished", now)
            set_condition(st, "Ready", "False", "Finished", "training finished", now)
            self.terminal()
            return
        exited = [p for p in trainers if ended_cleanly(p)]
        # A member still Pending (no node: an elastic gang above replicas.min) cannot
        # carry the stopped run on, and waiting for it waited for capacity, for good.
        holding = [p for p in trainers if p.active and p.phase != "Pending"]
        if exited and not holding and not self.trainer_being_deleted():
            self.stopped_early(exited)
            return
        # A rank that exited 0 waits for rank 0 to finish publishing: still in the gang.
        running = sum(p.running for p in trainers) + sum(p.phase == "Succeeded" for p in exited)
        scheduled = sum(p.scheduled for p in trainers)
        pending_restart = self.st.next_restart_at is not None and len(trainers) < replicas.max
        if running >= replicas.min and not pending_restart:
            if st.phase != "Running":
                was = st.phase
                self.event(
                    "Normal",
                    "Running",
                    f"trainer gang running ({running} of {replicas.min}..{replicas.max} pods)"
                    + (f" after {was}" if was not in (None, "Pending") else ""),
                )
                st.phase = "Running"
            st.message = f"training with {running} trainer pods"
            st.waiting_since = None
            set_condition(st, "Progressing", "True", "Training", st.message, now)
        elif self.awaiting_verdicts:
            # Not a restart yet: the verdicts may fail the job instead (without_awaited_verdicts).
            st.message = (
                f"a trainer pod failed; waiting for {_some(self.awaiting_verdicts)} to end "
                "before judging the gang"
            )
        else:
            if st.phase == "Running":
                st.phase = "Restarting"
                st.message = (
                    f"trainer gang below replicas.min ({running} of {replicas.min} running)"
                )
                self.event("Warning", "Restarting", st.message)
            elif st.phase in (None, "Pending"):
                st.phase = "Pending"
                st.message = f"waiting for the trainer gang ({running} of {replicas.min} running)"
            if st.waiting_since is None:
                st.waiting_since = rfc3339(now)
            set_condition(st, "Progressing", "False", st.phase or "Pending", st.message, now)
        hold = parse_time(st.next_restart_at)
        if hold is None or now >= hold:  # no pods to place during a restart's backoff
            self.scheduling(scheduled, replicas.min)
        want = len(self.desired().pods)
        all_running = sum(p.running for p in live)
        if all_running == want:
            set_condition(st, "Ready", "True", "AllPodsRunning", f"{want} pods running", now)
        elif not self.cannot_start:  # keep the more precise ImagePull/ConfigError reason
            set_condition(
                st, "Ready", "False", "PodsNotRunning", f"{all_running} of {want} pods running", now
            )

    def trainer_being_deleted(self) -> bool:
        """A trainer pod the cluster is taking, not judged yet: its end (a preemption,
        an eviction) or its going (lost_trainers) explains why its peers stopped, and is
        judged then, instead of a restart counted for the stop."""
        return any(
            p.role == N.ROLE_TRAINER and p.deleting and p.uid not in self.handled
            and p.name not in self.deleted
            for p in self.pods.values()
        )  # fmt: skip

    def scheduling(self, scheduled: int, need: int) -> None:
        st, now = self.st, self.now
        if scheduled >= need:
            set_condition(
                st,
                "Scheduled",
                "True",
                "GangScheduled",
                f"{scheduled} trainer pods scheduled (replicas.min {need})",
                now,
            )
            st.waiting_since = None if st.phase == "Running" else st.waiting_since
            return
        # Each message below is the same from one reconcile to the next: a status that
        # changed every second (the seconds waited) was written every second, and each
        # write, an event, started the next reconcile.
        leaving = sum(p.role == N.ROLE_TRAINER and p.deleting for p in self.pods.values())
        gated = sum(p.role == N.ROLE_TRAINER and p.gated for p in self.pods.values())
        if leaving or gated:
            # The previous gang still stops (its grace: an emergency checkpoint), and the
            # new pods take its pods' names; or Kueue holds the pods until it admits the
            # gang. Placement has not begun: the timeout counts from when it does (a
            # grace or a queue longer than schedulingTimeoutSeconds read as an
            # unschedulable gang).
            st.waiting_since = None
            if leaving:
                why = f"waiting for {leaving} trainer pods of the previous gang to stop"
                set_condition(st, "Scheduled", "Unknown", "Waiting", why, now)
                return
            why = (
                f"{gated} trainer pods wait for admission (scheduling gates: the gang's "
                "queue has not admitted them)"
            )
            if set_condition(st, "Scheduled", "False", "Queued", why, now):
                self.event("Normal", "Queued", why)
            return
        since = parse_time(st.waiting_since) or now
        waited = (now - since).total_seconds()
        timeout = self.spec.scheduling.scheduling_timeout_seconds
        if waited >= timeout:
            why = next(
                (
                    p.unschedulable
                    for p in self.pods.values()
                    if p.role == N.ROLE_TRAINER and p.unschedulable
                ),
                "",
            )
            message = (
                f"only {scheduled} of replicas.min={need} trainer pods scheduled within "
                f"schedulingTimeoutSeconds ({timeout})" + (f": {why}" if why else "")
            )
            before = condition(st, "Scheduled")
            changed = set_condition(st, "Scheduled", "False", "Unschedulable", message, now)
            if changed or (before is not None and before.reason != "Unschedulable"):
                self.event("Warning", "Unschedulable", message)
            if not why and waited < timeout + SCHEDULER_REASON_WAIT_SECONDS:
                # The scheduler has not said why yet (it may not have tried the pod since
                # the timeout began): look again soon, so the condition names the reason.
                self.requeue(SCHEDULER_REASON_POLL_SECONDS)
        else:
            set_condition(
                st,
                "Scheduled",
                "Unknown",
                "Waiting",
                f"{scheduled} of {need} trainer pods scheduled",
                now,
            )
            self.requeue(timeout - waited)

    # --------------------------------------------------------------------- main
    def run(self) -> Decision:
        st = self.st
        self.mirror_report()
        self.checkpointed_once()
        if st.phase in TERMINAL_PHASES:
            self.terminal()  # never runs again: an edit is kept, not applied
            return self.finish()
        if self.spec.suspend:
            self.suspend()
            self.settle(rescaling=False)  # pods are made from the spec on resume
            return self.finish()
        if st.phase == "Suspended":
            st.phase = "Pending"
            st.gang_attempt += 1
            st.waiting_since = rfc3339(self.now)
            self.event(
                "Normal",
                "Resumed",
                f"spec.suspend is false: recreating pods (--resume={self.resume()})",
            )
        if st.phase is None:
            self.event("Normal", "Creating", "creating the job's ConfigMap, Services and pods")
        self.handle_failures()
        if st.phase == "Failed":
            self.terminal()
            return self.finish()
        if self.d.set_suspend or self.pause_unfinished():
            return self.finish()
        self.waiting_problems()
        if st.phase == "Failed":
            self.terminal()
            return self.finish()
        self.hidden_oom()
        for pod in self.pods.values():
            # Counted failures leave their slot for the replacement; a trainer or Ray
            # pod counted while it runs belongs to a gang or instance already restarted
            # (an operator that died between the status write and the deletes left it
            # running: in the old rendezvous, or a head whose engine lost a node): it
            # goes too.
            if pod.uid in self.handled and (
                pod.phase in ("Failed", "Succeeded", "Unknown") or pod.role in RESTARTED_WHOLE
            ):
                self.delete(pod)
        self.force_stuck()
        self.lost_trainers()
        if st.phase == "Failed":  # a vanished trainer used up restartPolicy
            self.terminal()
            return self.finish()
        self.refresh_configs()  # before rescale: a waiting edit holds the gang's shape too
        self.rescale()
        self.ensure_children()
        self.update_phase()
        if st.phase == "Failed":  # trainers that stopped early used up restartPolicy
            self.terminal()
        self.settle(rescaling=st.gang_replicas not in (None, S.gang_replicas(self.spec)))
        return self.finish()

    def finish(self) -> Decision:
        # The CRD's maxLength: a longer one gets the whole status write refused (422).
        self.st.message = self.st.message[:MESSAGE_LENGTH]
        observed_uids = {p.uid for p in self.observed.pods}
        self.st.handled_pods = sorted(u for u in self.handled if u in observed_uids)
        return self.d


def reconcile(
    job: RLFineTune,
    body: dict[str, Any],
    status: Status,
    observed: Observed,
    now: datetime,
    settings: M.Settings | None = None,
) -> Decision:
    """Decide what to do for one job. `body` is the raw custom resource (metadata: name,
    namespace, uid, generation); `status` its parsed status."""
    return _Run(job, body, status, observed, now, settings or M.Settings()).run()


def _some(names: tuple[str, ...], shown: int = 3) -> str:
    """A few names of a list as long as a gang: the status message has a length limit."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more trainer pods"


def _nnodes(pod: dict[str, Any]) -> str | None:
    """`min:max` of a trainer pod's torchrun `--nnodes`."""
    for arg in pod["spec"]["containers"][0].get("command") or []:
        if arg.startswith("--nnodes="):
            return arg.removeprefix("--nnodes=")
    return None
