"""Errors of object storage: one message naming the object and what to do.

Messages are built from our own words plus redacted server text, never from raw
exception strings, so credentials can never leak into logs, events or status.
"""

from __future__ import annotations


class BadUriError(ValueError):
    """A checkpoint URI that names no usable location (the user must fix the job file)."""


class StorageError(Exception):
    """An object-store or file-system operation failed.

    `transient` says whether retrying can help (throttling, connection errors, a server
    that is restarting); permanent errors (missing bucket, rejected credentials, full
    disk) are reported at once instead of being retried until a deadline.
    """

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class ObjectMissingError(StorageError):
    """The object or file does not exist."""


class BucketMissingError(StorageError):
    """The bucket named by the URI does not exist."""


class CredentialsError(StorageError):
    """The object store rejected the credentials, or none were found."""


class StorageFullError(StorageError):
    """No space left on the device (ENOSPC); temporary files were removed."""


def redact(text: str, secrets: list[str | None]) -> str:
    """`text` with every non-empty secret replaced, so server messages can be shown."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text
