"""Exit codes of the trainer: how the operator learns what happened (see docs/architecture.md)."""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    """Finished (or stopped cleanly after an emergency checkpoint)."""
    FAILURE = 1
    """Anything unexpected: retryable."""
    INVALID_CONFIG = 2
    """The job file, its data or its model cannot be used: permanent, do not restart."""
    COLLAPSED = 3
    """The stability guard ended the run after a collapse (it rolls back in process; this
    is what its policy does once that is not possible or not allowed): permanent."""
