"""Fencing: a newer trainer gang of a job shuts out an older one still running.

The operator replaces a gang whose node stopped reporting by force-deleting its pods:
no kubelet is left to confirm they ended. When the node was only cut off (a network
partition, a kubelet or API server outage), its trainers keep training, and both gangs
would write the same checkpoint location: the old one moving `latest` to its own steps
and its retention deleting the new gang's as another timeline's.

Each operator-started gang has a higher attempt number (the status's gangAttempt, in
`$RLFT_GANG_ATTEMPT`). A gang's rank 0 writes it to `fences/<job uid>` before resuming;
a gang that finds a higher number there stops (`SupersededError`, on every rank): at
its start, at a save (before any rank uploads a file, and again before the commit) and
at the end of the first step `CHECK_SECONDS` after its last read. A save already
uploading when the new gang starts may still write files, never a manifest or `latest`.
The rollout instances fence weights on their own: a weight load carries the sender's
gang attempt, and an instance that took a newer gang's weights refuses an older one's
(`SupersededGangError`, rollout/protocol.py). A local `rlft train` has no job uid and no
fence.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from rlft.trainer.checkpoint.errors import CheckpointError, ObjectMissingError, StorageError
from rlft.trainer.learner.faults import operator_gang_attempt
from rlft.trainer.storage.backends import Storage

FENCES = "fences"
"""Folder of the fence objects at a checkpoint location (not a step folder)."""
JOB_UID_ENV = "RLFT_JOB_UID"
"""Set by the operator in trainer pods: the RLFineTune's metadata.uid."""
CHECK_SECONDS = 30.0
"""How often a running gang reads its fence between saves."""


class SupersededError(CheckpointError):
    """A newer gang of this job started: this one must not write the location again."""


class Fence:
    """This gang's attempt at a checkpoint location, checked against the newest one."""

    def __init__(
        self,
        storage: Storage,
        job_uid: str,
        attempt: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.storage = storage
        self.key = f"{FENCES}/{job_uid}"
        self.attempt = attempt
        self.clock = clock
        self._checked_at = -float("inf")

    @classmethod
    def from_environment(cls, storage: Storage) -> Fence | None:
        """The fence of an operator-started gang (its job uid and attempt in the pod's
        environment), or None."""
        uid, attempt = os.environ.get(JOB_UID_ENV), operator_gang_attempt()
        if not uid or attempt is None:
            return None
        return cls(storage, uid, attempt)

    def newest(self) -> int | None:
        """The attempt the location was last claimed by (None: never)."""
        try:
            text = self.storage.get_bytes(self.key).decode(errors="replace").strip()
        except ObjectMissingError:
            return None
        return int(text) if text.isdigit() else None

    def claim(self) -> None:
        """Rank 0, before the gang resumes: this attempt is the newest (written there),
        or SupersededError. Retries are the caller's (StorageError)."""
        self.check(force=True)

    def check(self, force: bool = False) -> None:
        """SupersededError when a newer attempt claimed the location; read at most every
        CHECK_SECONDS unless `force`."""
        now = self.clock()
        if not force and now - self._checked_at < CHECK_SECONDS:
            return
        self._checked_at = now
        newest = self.newest()
        if newest is None or newest < self.attempt:
            # Two claims read and wrote in turn, the older gang's last: the newer one
            # writes its own again, so the higher attempt holds within one check.
            self.storage.put_bytes(self.key, str(self.attempt).encode())
            return
        if newest > self.attempt:
            raise SupersededError(
                f"trainer gang attempt {self.attempt} was replaced by attempt {newest} "
                f"({self.storage.uri}/{self.key}): the operator started a newer gang (it "
                "lost contact with this one's node); this gang stops without writing "
                "another checkpoint"
            )


def claim_fence(
    storage: Storage, is_main: bool, broadcast: Callable[[object], object], retry_s: float
) -> Fence | None:
    """This gang's fence, claimed by rank 0 before the gang resumes (every rank calls
    this; `broadcast` sends rank 0's value to all): SupersededError on every rank when a
    newer gang holds the location already. None outside the operator."""
    from rlft.trainer.storage.retry import with_retries

    fence = Fence.from_environment(storage)
    if fence is None:
        return None
    refused: tuple[str, str] | None = None
    if is_main:
        try:
            with_retries(fence.claim, deadline_s=retry_s)
        except (SupersededError, StorageError) as error:  # on every rank, not rank 0's alone
            refused = (type(error).__name__, str(error))
    refused = broadcast(refused)
    if refused:
        kind, message = refused
        raise SupersededError(message) if kind == "SupersededError" else StorageError(message)
    return fence
