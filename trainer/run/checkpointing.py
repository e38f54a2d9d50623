"""Checkpoints of a running job and resuming from them, around the step loops.

What a checkpoint of the main phase holds: the policy and its optimizer (sharded), PPO's
critic and its optimizer, the frozen reference (KL, DPO), and the loop's cursor (step,
policy version, the data and sampling random streams, results of the warm start), and
rank 0's metrics.jsonl up to its step. A run killed at any point resumes from the newest
committed checkpoint and continues exactly as the uninterrupted run would have (bit for
bit on the CPU at the same world size); its metrics.jsonl is the checkpoint's history
then the resumed steps, also in a new pod whose local files are gone.
The warm start is not checkpointed: a run killed during it starts again (deterministic).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

import torch

from rlft.trainer.checkpoint import (
    DamagedCheckpointsError,
    GracefulStop,
    NoCheckpointError,
    checkpointer_from_spec,
)
from rlft.trainer.checkpoint import load as load_checkpoint
from rlft.trainer.checkpoint.errors import LocationTakenError, StorageError
from rlft.trainer.checkpoint.export import hf_files_of
from rlft.trainer.checkpoint.fence import JOB_UID_ENV, SupersededError, claim_fence
from rlft.trainer.checkpoint.history import MetricsHistory
from rlft.trainer.checkpoint.manifest import FRESH_START, resume_order
from rlft.trainer.config import RLFineTune, dump_job
from rlft.trainer.distributed import Dist
from rlft.trainer.distributed.peer_stop import PeerStop
from rlft.trainer.run.state import Cursor
from rlft.trainer.storage.retry import with_retries

PAUSED = "paused"
"""In a checkpoint's extra state: written by the collapse guard's pause."""


class StopRequested(Exception):
    """SIGTERM arrived after `step`; `checkpointed` is the newest committed checkpoint
    (`step`'s own unless its emergency save failed; None before any)."""

    def __init__(self, step: int, checkpointed: int | None):
        if not step:
            message = (
                "stopped before the first training step (nothing to checkpoint; a warm "
                "start is not checkpointed, and a restart runs it again)"
            )
        elif checkpointed == step:
            message = f"stopped after the emergency checkpoint of step {step}"
        else:
            # The save's own error is logged and counted; the resume goes back further.
            earlier = f"step {checkpointed}" if checkpointed else "none"
            message = (
                f"stopped after step {step}, whose emergency checkpoint failed "
                f"(the newest committed checkpoint: {earlier})"
            )
        super().__init__(message)
        self.step = step
        self.checkpointed = checkpointed


class Checkpointing:
    """The job's checkpointer, SIGTERM handling, and resume, on every rank."""

    def __init__(self, job: RLFineTune, out: Path, dist: Dist, policy, tokenizer, supervisor):
        spec = job.spec.checkpoint
        self.dist = dist
        self.supervisor = supervisor
        self.metrics = out / "metrics.jsonl"
        self.resumed_step: int | None = None
        """The step this run resumed from (its checkpoint is committed)."""
        self.timeline_base: int | None = None
        """The step this run's weights descend from: the one it resumed from or rolled
        back to last (None: a fresh start). With `own_commits`, what a rollback may
        restore: folders above it that this run did not commit since are an abandoned
        timeline (a `--resume N` below `latest`, an earlier rollback), still present
        until a commit moves `latest` and retention deletes them."""
        self.fresh_because: str | None = None
        """Why `resume` found a checkpoint and still starts afresh (a pause's only)."""
        self.own_commits: set[int] = set()
        """Steps this run committed since `timeline_base` (rank 0's saver reports them)."""
        self.stop = GracefulStop(spec.grace_period_seconds, rank=dist.rank).install()
        self.peers = PeerStop.of(dist)
        """The group's shared stop flag: rank 0 polls it while it waits alone, every
        rank while it waits for its save's retries."""
        if self.peers is not None:
            self.peers.watch(self.stop.signals)
        self.retry_s = spec.upload_retry_minutes * 60
        """How long reads the store refuses are retried (resume, rollback, the scan)."""
        job_uid = os.environ.get(JOB_UID_ENV) or None
        self.operator_run = job_uid is not None
        """Started by the operator (its restarts may find an earlier attempt's files)."""
        self.elsewhere = spec.uri is not None
        """The checkpoints live at spec.checkpoint.uri, not in the output folder (whose
        own previous run `prepare_output` guards)."""
        self.own_only = job_uid if spec.resume == "never" else None
        """`resume: never` on the operator: only this job's checkpoints (by the job uid in
        their manifests) are ever resumed or rolled back to, others' never."""
        self.checkpointer = checkpointer_from_spec(
            spec,
            out / "checkpoints",
            job_config=dump_job(job),
            hf_files=hf_files_of(policy, tokenizer) if dist.is_main else {},
            on_event=self._on_event,
            job_uid=job_uid,
        )
        self.history = MetricsHistory(self.checkpointer.storage, self.metrics, self.retry_s)
        self.checkpointer.fence = claim_fence(
            self.checkpointer.storage, dist.is_main, dist.broadcast, self.retry_s
        )
        self.checkpointer.descend_from(FRESH_START)  # until a resume says otherwise

    def _refuse_others_checkpoints(self) -> None:
        """A local run told `never` at a location that holds committed checkpoints: its
        commits would move `latest` below them and retention would delete them (the
        operator tells jobs apart by uid; here only --overwrite says to abandon them)."""
        if not self.elsewhere or self.operator_run:
            return
        steps = self.dist.broadcast(sorted(self._scan().manifests) if self.dist.is_main else None)
        if steps:
            raise LocationTakenError(
                f"{self.checkpointer.storage.uri} holds committed checkpoints (steps "
                f"{', '.join(map(str, steps[-5:]))}{' …' if len(steps) > 5 else ''}), and "
                "this run (resume: never) would overwrite them: pass --overwrite to abandon "
                "them, give the job another spec.checkpoint.uri, or --resume auto to go on "
                "from them"
            )

    def choice(self, which: str | int) -> str | int:
        """Rank 0's `which`, on every rank: pods of one gang may have been started with
        different --resume arguments (a replaced pod, survivors restarted in place), and
        all ranks must load the same checkpoint. Except that a `never` job whose own
        checkpoints are at the location (an earlier gang of it wrote them: an emergency
        checkpoint the operator never saw, say) resumes them: never is about other runs'
        checkpoints, and starting afresh would move `latest` below the job's own steps."""
        which = self.dist.broadcast(which)
        if which != "never":
            return which
        if self.own_only is None:
            self._refuse_others_checkpoints()
            return which
        found = None
        if self.dist.is_main:
            scan = self._scan()
            others = sorted({m.job_uid for m in scan.manifests.values()} - {None, self.own_only})
            found = ("own", []) if scan.own(self.own_only) else ("others", others)
        kind, others = self.dist.broadcast(found)
        if kind == "own":
            self.supervisor.log("rlft: this job's own checkpoints are here: resuming them")
            return "latest-healthy"
        if others:
            raise LocationTakenError(
                f"{self.checkpointer.storage.uri} holds the committed checkpoints of another "
                f"job (uid {', '.join(others)}), and this one (resume: never) would "
                "overwrite them: give it its own spec.checkpoint.uri, or delete them "
                "(`rlft checkpoints list` shows them), or set resume: auto to go on from them"
            )
        return which

    def _scan(self):
        """The location's checkpoints, retried while the store refuses for a while."""
        return with_retries(self.checkpointer.catalog.scan, deadline_s=self.retry_s)

    def _on_event(self, name: str, info: dict[str, Any]) -> None:
        if name == "committed":
            self.own_commits.add(info["step"])
            self.supervisor.checkpointed(info["step"], info["uri"], info["healthy"])
        elif name == "pruned":  # saver thread: the history's and the timeline's share
            self.own_commits.difference_update(info["steps"])
            self.history.collect(info["step"])
        elif name == "retry":
            message = f"checkpoint of step {info.get('step')}: {info.get('what')} retried"
            self.supervisor.checkpoint_retry(f"{message} ({info.get('error')})", info.get("step"))
        elif name == "peer_retries":
            message = f"checkpoint of step {info['step']}: other ranks retried storage calls"
            self.supervisor.checkpoint_retry(message, info["step"], info["count"])
        elif name == "failed":
            self.supervisor.checkpoint_failed(info["step"], info["uri"], info["error"])

    @property
    def stats(self):
        return self.checkpointer.stats

    @property
    def last_step(self) -> int | None:
        """The step of the newest checkpoint this run committed or resumed from."""
        last = self.checkpointer.stats.last_step
        return last if last is not None else self.resumed_step

    def stopping(self) -> bool:
        """SIGTERM arrived: this rank's own, or any rank's (rank 0 alone waits for
        rollouts while its peers wait for it in a collective, deaf to their own; a rank
        waiting for its save's retries has no step's collective to share one)."""
        if self.stop.requested:
            return True
        return self.peers is not None and self.peers.requested()

    def resume(self, which: str | int, learner) -> Cursor | None:
        """Restore the newest checkpoint `which` (from `choice`: the same on every rank)
        selects; None when there is none."""
        try:
            resumed = self._load(which, learner, restore_rng=True)
            if which == "auto" and resumed.extra.get(PAUSED):
                # Its guard state holds the collapse: resumed, it would pause again after
                # its first step, and again on every later try.
                step = resumed.manifest.step
                self.supervisor.log(
                    f"rlft: the newest checkpoint, step {step}, is the one the collapse "
                    "guard's pause wrote: resuming from the newest healthy checkpoint "
                    f"(--resume {step} resumes the paused state itself)"
                )
                which = "latest-healthy"
                resumed = self._load(which, learner, restore_rng=True)
        except (NoCheckpointError, DamagedCheckpointsError) as error:
            if which == "auto" and isinstance(error, NoCheckpointError):
                return None
            if which != "latest-healthy":
                raise  # a step the user named, or damage: never a fresh start over it
            # The operator restarts every failed gang with latest-healthy; a failure
            # before the first healthy checkpoint (or with the healthy ones damaged) must
            # still recover from an intact one.
            warn = self.supervisor.log
            self.supervisor.event("resume", "no intact healthy checkpoint", "warning")
            paused = self._newest_paused()
            if paused is not None:
                # Resumed, it would pause again after its first step, on every try; the
                # newest healthy state is the beginning.
                warn(
                    "rlft: warning: no intact healthy checkpoint, and the newest one, step "
                    f"{paused}, is the one the collapse guard's pause wrote: starting from "
                    f"the beginning (until this run's first checkpoint, --resume {paused} "
                    "resumes the paused state itself)"
                )
                self.fresh_because = (
                    f"the only checkpoint to go on from is step {paused}'s, which the "
                    f"collapse guard's pause wrote (--resume {paused} resumes it)"
                )
                return None
            warn("rlft: warning: no intact healthy checkpoint; resuming from the newest one")
            try:
                resumed = self._load("auto", learner, restore_rng=True)
            except NoCheckpointError:
                warn("rlft: warning: no checkpoint at all; starting from the beginning")
                return None
        self.supervisor.load_state_dict(resumed.extra.get("guard", {}))
        manifest = resumed.manifest
        self.supervisor.resumed_from(
            manifest.step, resumed.uri, manifest.healthy, manifest.created_at
        )
        cursor = Cursor.from_json(resumed.extra["cursor"])
        self.resumed_step = cursor.step
        self._descend_from(cursor.step)
        if self.dist.is_main:
            self.history.restore(resumed.extra, cursor.step, self.supervisor.log)
        return cursor

    def _newest_paused(self) -> int | None:
        """The step of the checkpoint `auto` takes when the guard's pause wrote it (rank 0
        reads its extra.json, no tensors; every rank gets the answer)."""
        found = None
        if self.dist.is_main:
            scan = self._scan()
            if self.own_only is not None:
                scan = scan.without_other_jobs(self.own_only)
            order = resume_order(scan.committed, scan.latest, "auto", scan.parents)
            try:
                if order and self.checkpointer.catalog.read_extra(order[0]).get(PAUSED):
                    found = order[0]
            except (StorageError, ValueError):
                pass  # not known to be paused: the load names what is wrong with it
        return self.dist.broadcast(found)

    def _load(self, which, learner, restore_rng: bool):
        resumed = load_checkpoint(
            self.checkpointer.storage,
            which,
            learner.models.policy,
            learner.optimizer,
            modules=_modules(learner),
            restore_rng=restore_rng,
            job_uid=self.own_only,
            retry_s=self.retry_s,
        )
        learner.sync_engine_model()
        return resumed

    def rollback(self, before_step: int, cursor: Cursor, learner, replay_data: bool) -> int:
        """Restore the newest healthy checkpoint older than `before_step` into the live
        run; the data and sampling streams go on from where they are (past the bad
        window), or with `replay_data` from where the checkpoint had them (the window is
        trained on again). Returns the restored step; RunEnded-worthy NoCheckpointError
        if none."""
        self._wait_for_save(cursor.step)  # the rollback's own is saved at its end
        candidates: list[int] = []
        if self.dist.is_main:
            scan = self._scan()
            if self.own_only is not None:
                scan = scan.without_other_jobs(self.own_only)
            # Off the pointer's timeline too: a commit whose retention failed leaves the
            # steps it abandoned, and a restart resumed past them.
            abandoned = scan.abandoned
            healthy = [
                step
                for step, ok in scan.committed.items()
                if ok and step < before_step and self._on_timeline(step) and step not in abandoned
            ]
            candidates = sorted(healthy, reverse=True)
        candidates = self.dist.broadcast(candidates)
        if not candidates:
            raise NoCheckpointError(f"no healthy checkpoint before step {before_step}")
        # Each candidate by name: a damaged one is skipped for the next older healthy one,
        # never for an unhealthy one (restoring the collapse the rollback escapes).
        damaged: list[str] = []
        for target in candidates:
            try:
                resumed = self._load(target, learner, restore_rng=False)
                break
            except DamagedCheckpointsError as error:
                damaged.append(error.found)
        else:
            raise NoCheckpointError(
                f"no intact healthy checkpoint to roll back to before step {before_step} "
                f"({'; '.join(damaged)})"
            )
        self._descend_from(target)
        if self.dist.is_main:
            self._point_at(target)
        # The restored weights are a new version, not the checkpoint's again: versions
        # only grow, so rollout servers, the weight store and the staleness gate never
        # see a number reused for other weights.
        cursor.policy_version += 1
        if replay_data:
            cursor.set_streams(resumed.extra["cursor"])
        self.supervisor.load_state_dict(resumed.extra.get("guard", {}), rollback=True)
        # Saved at the end of this step, not at the next one due: until then the rollback
        # (its weights, counter, learning-rate scale, the data past the bad window) lived
        # in memory only, and a crash resumed the state it had escaped, uncounted.
        self.checkpointer.save_soon()
        return target

    def _wait_for_save(self, step: int) -> None:
        """Wait for the save in flight, before `step`'s. A SIGTERM meanwhile bounds its
        retries (a store outage: uploadRetryMinutes) by the grace period left, as a stop
        between steps does: otherwise the grace watchdog ended the run first, without a
        verdict."""
        while not self.checkpointer.wait(timeout=1.0):
            if self.stopping():
                self.checkpointer.hurry(self._grace_left(), step)

    def _grace_left(self) -> float:
        """Seconds a stopping rank's saves may still retry: its own signal's grace left,
        and the first signalled rank's (a rank stopping because another was signalled,
        whose own `remaining` is unbounded); a whole grace period from now if that one's
        time cannot be read."""
        since = self.peers.seconds_since(self.stop.grace_seconds) if self.peers else None
        shared = self.stop.budget_seconds - (since or 0.0)
        return max(0.0, min(self.stop.remaining(), shared))

    def _point_at(self, step: int) -> None:
        """Rank 0, after a rollback: `latest` names the restored checkpoint at once, so a
        crash before the next commit resumes it, not the collapse rollback escaped."""
        catalog = self.checkpointer.catalog
        try:
            # Not past the grace period a SIGTERM started: the emergency save is due.
            deadline = min(60.0, self.retry_s, self.stop.remaining())
            with_retries(lambda: catalog.point_at(step), deadline_s=deadline)
        except StorageError as error:
            # The save due at the end of this step moves it too.
            self.supervisor.log(
                f"rlft: warning: could not point {catalog.storage.uri}/latest at the "
                f"restored step {step} ({error}); the next commit moves it"
            )

    def _descend_from(self, step: int) -> None:
        self.timeline_base = step
        self.own_commits.clear()
        self.checkpointer.descend_from(step)

    def _on_timeline(self, step: int) -> bool:
        """Whether the checkpoint of `step` holds this run's past: at or below the step
        it descends from, or committed by it since."""
        base = self.timeline_base
        return (base is not None and step <= base) or step in self.own_commits

    def stop_unsaved(self) -> None:
        """After a step of a phase that is not checkpointed (the warm start): raise
        StopRequested when any rank got SIGTERM (collective: every rank calls it)."""
        flag = torch.tensor([int(self.stop.requested)])
        if self.dist.all_reduce(flag, "max").item():
            self.close()
            raise StopRequested(0, self.last_step)

    def end_of_step(self, cursor: Cursor, learner) -> None:
        """Save when due; on SIGTERM save synchronously and raise StopRequested."""
        decision = self.checkpointer.poll(cursor.step, self.stop.requested)
        if decision.superseded is not None:
            self.close()
            raise SupersededError(decision.superseded or "a newer gang replaced this one")
        if not decision.save:
            return
        self._save(cursor, learner, wait=decision.stop, emergency=decision.stop)
        if decision.stop:
            self.close()
            raise StopRequested(cursor.step, self.last_step)

    def stop_between_steps(self, cursor: Cursor, learner) -> NoReturn:
        """SIGTERM came while rank 0 waited for the next step's batch: checkpoint the
        step finished last, unless a checkpoint of it is committed or in flight (saving
        it again would withdraw its manifest while the files are replaced), and raise
        StopRequested. Every rank calls this (the loop broadcast the stop)."""
        # A save in flight retries within the grace left, not its own whole deadline.
        self.checkpointer.hurry(self._grace_left(), cursor.step)
        self.checkpointer.wait()
        if cursor.step not in (self.last_step, 0):
            self._save(cursor, learner, wait=True, emergency=True)
        self.close()
        raise StopRequested(cursor.step, self.last_step)

    def final(self, cursor: Cursor, learner, paused: bool = False) -> None:
        """The last step's checkpoint, committed before the run reports success (or
        `paused`: the collapse guard's pause, which `auto` then resumes past); not again
        when it is the one this run resumed from (a run killed after its last
        checkpoint): saving it again would withdraw the manifest `latest` names while
        its files are replaced."""
        self._wait_for_save(cursor.step)
        if cursor.step != self.last_step and not self._save(
            cursor, learner, wait=True, paused=paused
        ):
            if self.checkpointer.superseded:  # its model is not the job's output either
                raise SupersededError(self.checkpointer.superseded)
            # The run's model is still written (and published) as its output; what is
            # lost is the optimizer state to train on from this step.
            newest = f"step {self.last_step}" if self.last_step is not None else "none"
            self.supervisor.log(
                f"rlft: warning: the final checkpoint of step {cursor.step} failed; the "
                f"newest committed checkpoint: {newest}"
            )

    def _save(
        self, cursor: Cursor, learner, wait: bool, emergency: bool = False, paused: bool = False
    ) -> bool:
        """Checkpoint the step; with `wait`, whether it committed. `emergency`: on a stop
        signal (any rank's: the manifest says so even where rank 0, which writes it, was
        not the one signalled)."""
        history: dict = {}
        segments: dict[str, bytes] = {}
        if self.dist.is_main:
            # Not waited for: a save still in flight counts as not committed (the new
            # segment covers its lines again), and an emergency save must not wait out
            # its predecessor's retries before the saver hurries them.
            history, segments = self.history.for_save(cursor.step, self.last_step)
        return self.checkpointer.save(
            cursor.step,
            learner.models.policy,
            learner.optimizer,
            extra={
                "cursor": cursor.to_json(),
                "guard": self.supervisor.state_dict(),
                **history,
                **({PAUSED: True} if paused else {}),
            },
            shared_files=segments,
            policy_version=cursor.policy_version,
            healthy=self.supervisor.healthy(),
            modules=_modules(learner),
            wait=wait,
            emergency=emergency,
            retry_seconds=self._grace_left() if emergency or self.stopping() else None,
        )

    def close(self) -> None:
        self.checkpointer.close()
        if self.peers is not None:
            self.peers.close()
        self.stop.uninstall()


def _modules(learner) -> dict:
    modules = {}
    if learner.models.critic is not None:
        modules["critic"] = (learner.models.critic, learner.critic_optimizer)
    if learner.reference is not None:
        modules["reference"] = (learner.reference, None)
    return modules
