"""Errors of the checkpoint subsystem: one message naming the object and what to do.
Storage errors (`rlft.trainer.storage.errors`) are re-exported: a checkpoint operation
raises either kind.

Messages are built from our own words plus redacted server text, never from raw
exception strings, so credentials can never leak into logs, events or status.
"""

from __future__ import annotations

from rlft.trainer.storage.errors import (
    BadUriError,
    BucketMissingError,
    CredentialsError,
    ObjectMissingError,
    StorageError,
    StorageFullError,
    redact,
)

__all__ = [
    "BadUriError",
    "BucketMissingError",
    "CheckpointError",
    "CredentialsError",
    "DamagedCheckpointsError",
    "ForeignCheckpointError",
    "LocationTakenError",
    "ManifestError",
    "NewerFormatError",
    "NoCheckpointError",
    "ObjectMissingError",
    "StorageError",
    "StorageFullError",
    "redact",
]


class CheckpointError(Exception):
    """Base of every checkpoint error."""


class ManifestError(CheckpointError):
    """A manifest that cannot be parsed: the checkpoint counts as damaged."""


class NewerFormatError(ManifestError):
    """A checkpoint written by a newer rlft: not damaged, and never removed or skipped
    over by this one (upgrade rlft)."""


class NoCheckpointError(CheckpointError):
    """No committed, intact checkpoint matches what was asked for."""


class LocationTakenError(CheckpointError):
    """A `resume: never` job starting at a location that holds another job's committed
    checkpoints: its own would overwrite theirs (same step folders, one `latest`)."""


class DamagedCheckpointsError(CheckpointError):
    """Committed checkpoints are there but none of those asked for is intact. Not a
    NoCheckpointError on purpose: starting afresh would move `latest` back to the new
    run's first checkpoint and abandon every step the damaged ones hold."""

    def __init__(self, message: str, found: str):
        super().__init__(message)
        self.found = found
        """Each damaged folder and why, for callers that word their own message."""


class ForeignCheckpointError(CheckpointError):
    """The checkpoint holds another model (other shapes or parameters): a restart would
    meet it again (exit 2)."""
