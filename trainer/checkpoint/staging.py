"""Each rank's stage: the local folder where its checkpoint shards are written before
they are uploaded (or renamed into a file:// location).

A stage is locked (`flock` on its `.lock`) while its Checkpointer lives. The lock says
whose it is: a process killed mid-save leaves its stage behind, unlocked, and the next
Checkpointer to start beside it removes it; a stage still locked belongs to a live
process (two jobs sharing a staging folder, or a gang starting while the old one is
still terminating) and is never touched, the newcomer taking a folder of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from hashlib import sha256
from pathlib import Path

LOCK = ".lock"
STAGE_NAME = re.compile(r"rank-\d+(-\d+)?")
"""A stage's folder name: `rank-N`, or `rank-N-PID` when another process holds that."""
_DEFAULT_PARENT = re.compile(r"rlft-staging-[0-9a-f]{12}")


def default_parent(uri: str) -> Path:
    """The staging folder of a location without a `stagingDir`: one per location, in the
    temporary directory (`remove_abandoned` sweeps those of other locations)."""
    return Path(tempfile.gettempdir()) / f"rlft-staging-{sha256(uri.encode()).hexdigest()[:12]}"


def _lock(folder: Path) -> int | None:
    """An exclusive lock on `folder` (made if missing), or None when a live process holds
    it. The descriptor keeps the lock until closed (or the process ends)."""
    for _ in range(3):
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
        except FileNotFoundError:  # removed in between as stale by another starter
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        # Locked, but maybe a lock file another starter removed (with its folder) meanwhile.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(folder / LOCK).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)
    return None


class StagingDirError(ValueError):
    """The staging folder cannot be made (a configuration error: exit 2)."""


class Stage:
    """This rank's stage folder under `parent`, locked until `release`."""

    def __init__(self, parent: Path, rank: int):
        self.parent = parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StagingDirError(
                f"spec.checkpoint.stagingDir: cannot make {parent} ({error.strerror}): "
                "give a writable folder with room for this rank's share of a checkpoint"
            ) from None
        for name in (f"rank-{rank}", f"rank-{rank}-{os.getpid()}"):
            fd = _lock(parent / name)
            if fd is not None:
                self.folder, self._fd = parent / name, fd
                break
        else:
            raise RuntimeError(f"no stage folder for rank {rank} could be locked in {parent}")
        self._clear(self.folder)
        remove_stale(parent, keep=self.folder)

    @staticmethod
    def _clear(folder: Path) -> None:
        for entry in folder.iterdir():
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def release(self, remove_parent: bool) -> None:
        """Remove the stage (each save already removed its own step folder) and, when
        asked and nobody else's stage is left in it, its parent."""
        if self._fd < 0:
            return
        shutil.rmtree(self.folder, ignore_errors=True)
        os.close(self._fd)
        self._fd = -1
        if remove_parent:
            with contextlib.suppress(OSError):
                self.parent.rmdir()


def remove_stale(parent: Path, keep: Path | None = None) -> None:
    """Stages in `parent` nobody holds: left by killed processes (also of ranks this
    world no longer has, after a resize)."""
    for folder in parent.iterdir():
        # Only stages: a user's staging folder may hold other things.
        if folder == keep or not STAGE_NAME.fullmatch(folder.name):
            continue
        if not folder.is_dir() or folder.is_symlink():
            continue
        fd = _lock(folder)
        if fd is not None:
            shutil.rmtree(folder, ignore_errors=True)
            os.close(fd)


def remove_abandoned(root: Path, keep: Path) -> None:
    """Stages nobody holds in the other default staging folders under `root` (the
    temporary directory), and those folders once empty: a run killed mid-save whose
    location never runs again would otherwise keep its shards there for good. Stages of
    live processes are locked and stay; nothing else in `root` is looked at."""
    with contextlib.suppress(OSError):
        for parent in root.iterdir():
            if parent == keep or not _DEFAULT_PARENT.fullmatch(parent.name):
                continue
            if not parent.is_dir() or parent.is_symlink():
                continue
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
                remove_stale(parent)
                parent.rmdir()  # only when empty: a live stage or anything else keeps it
