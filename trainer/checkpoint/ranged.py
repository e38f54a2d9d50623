"""Resume reads only what a rank loads: the pieces of the shard files it needs, each
checked against the manifest's per-piece SHA-256.

A sharded checkpoint's files hold every rank's shards, and each rank loads a part of a
few of them (its shards of each parameter, and the small replicated values spread over
all files). Downloading whole files made every rank fetch the whole checkpoint: N ranks,
N times its size from the store. DCP's own load plan says which byte ranges each rank
reads; `BlockReader` fetches the manifest pieces covering them, just before DCP reads
them, into a sparse local copy at the same offsets. A piece that does not match its
checksum raises `BlockDamaged`, which DCP hands to every rank, so all ranks skip the
checkpoint alike.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from rlft.trainer.checkpoint.manifest import FileEntry, Manifest
from rlft.trainer.storage.backends import Storage, os_error
from rlft.trainer.storage.errors import ObjectMissingError, StorageError, StorageFullError
from rlft.trainer.storage.retry import with_retries
from rlft.trainer.telemetry import liveness


class BlockDamaged(Exception):
    """A piece of a shard file is missing or does not match its checksum."""


class Blocks:
    """The shard files of one checkpoint that are fetched piece by piece, as DCP reads
    them, into `folder` (each file pre-sized, holes where nothing was fetched)."""

    def __init__(self, storage: Storage, manifest: Manifest, folder: Path, retry_s: float):
        self.storage = storage
        self.manifest = manifest
        self.folder = folder
        self.retry_s = retry_s
        self.entries = {e.path: e for e in manifest.files if e.blocks}
        self.fetched: set[tuple[str, int]] = set()

    def prepare(self) -> None:
        """Each file at its full size, all holes (the file system stores none of it)."""
        for entry in self.entries.values():
            path = self.folder / entry.path
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as out:
                out.truncate(entry.size)

    def ensure(self, path: str, spans: Iterable[tuple[int, int]]) -> None:
        """Fetch and check the pieces of `path` covering each (offset, length) span."""
        entry = self.entries.get(path)
        if entry is None:
            return  # downloaded whole and checked already
        size = self.manifest.block_bytes
        needed = sorted(
            {
                index
                for offset, length in spans
                for index in range(offset // size, (offset + max(length, 1) - 1) // size + 1)
            }
        )
        for index in needed:
            if (path, index) not in self.fetched:
                self._fetch(entry, index)

    def _fetch(self, entry: FileEntry, index: int) -> None:
        size = self.manifest.block_bytes
        start = index * size
        length = min(size, entry.size - start)
        key = f"{self.manifest.folder}/{entry.path}"
        span = f"bytes {start}-{start + length - 1}"
        if index >= len(entry.blocks) or length < 0:
            raise BlockDamaged(f"{entry.path}: {span} are past its {entry.size} bytes")
        liveness.beat(f"downloading {key} ({span})")
        try:
            data = with_retries(
                lambda: self.storage.get_range(key, start, length), deadline_s=self.retry_s
            )
        except ObjectMissingError:
            raise BlockDamaged(f"{entry.path}: missing") from None
        if len(data) != length:  # the stored file is shorter than the manifest says
            raise BlockDamaged(f"{entry.path}: truncated ({len(data)} of {span} stored)")
        if hashlib.sha256(data).hexdigest() != entry.blocks[index]:
            raise BlockDamaged(f"{entry.path}: checksum mismatch (corrupted) in {span}")
        try:
            fd = os.open(self.folder / entry.path, os.O_WRONLY)
            try:
                # A write short of space returns what fit; the next one raises ENOSPC
                # (ignored, the hole read as zeros and DCP saw a corrupted file).
                written, view = 0, memoryview(data)
                while written < length:
                    written += os.pwrite(fd, view[written:], start + written)
            finally:
                os.close(fd)
        except OSError as error:
            failure = os_error(error, f"writing {span} of {key}", str(self.folder), room=None)
            raise resume_copy_failure(failure, self.folder) from None
        self.fetched.add((entry.path, index))


def resume_copy_failure(error: StorageError, folder: Path) -> StorageError:
    """A full local disk under the resume's copy says where the copy goes (each older
    checkpoint, taken for damaged in turn, would fail the same)."""
    if not isinstance(error, StorageFullError):
        return error
    return StorageFullError(
        f"{error}; the copy for the resume goes to {folder} (set TMPDIR to a folder on a "
        "larger volume)"
    )


class BlockReader(FileSystemReader):
    """DCP's file reader over a folder whose shard files `blocks` fills on demand."""

    def __init__(self, path: Path, blocks: Blocks):
        super().__init__(path)
        self.blocks = blocks

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        spans: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            spans.setdefault(stored.relative_path, []).append((stored.offset, stored.length))
        for path, wanted in spans.items():
            self.blocks.ensure(path, wanted)
        return super().read_data(plan, planner)


def storage_failure(error: CheckpointException) -> StorageError | None:
    """A store failure a load met (retried to its deadline), to be raised as itself."""
    return next(
        (f for _, (f, _) in sorted(error.failures.items()) if isinstance(f, StorageError)), None
    )


def damage_in(error: CheckpointException) -> list[str]:
    """The damaged pieces a failed load found, on any rank (empty: another failure). A
    shard file of a local checkpoint that vanished once checked (deleted meanwhile, by
    the retention of a run writing there) is missing, as one found absent is."""
    found = (
        str(f) if isinstance(f, BlockDamaged) else f"{Path(f.filename or '?').name}: missing"
        for _, (f, _) in sorted(error.failures.items())
        if isinstance(f, BlockDamaged | FileNotFoundError)
    )
    return list(dict.fromkeys(found))


_FOREIGN = ("Size mismatch", "Missing key in checkpoint")
"""What DCP says when the checkpoint's tensors are not the model's."""


MODULE_NEEDS = {
    "reference": "a frozen reference (spec.algorithm.kl.coef above 0, or the algorithm's own)",
    "critic": "a critic (algorithm ppo)",
}
"""The models a run may hold beside the policy (checkpoint/state.py Modules), and what
in the job asks for each."""


def missing_module(foreign: str) -> str | None:
    """The model beside the policy that a checkpoint lacks entirely, from DCP's
    `Missing key in checkpoint state_dict: reference.model.…`; None for another mismatch."""
    key = foreign.partition("Missing key in checkpoint state_dict:")[2].strip()
    module = key.split(".", 1)[0]
    return module if module in MODULE_NEEDS else None


def foreign_in(error: CheckpointException) -> str | None:
    """DCP's first word that the checkpoint holds another model, if it said one."""
    for _, (failure, _) in sorted(error.failures.items()):
        text = str(failure).strip()
        if any(sign in text for sign in _FOREIGN):
            return text.splitlines()[0][:300]
    return None
