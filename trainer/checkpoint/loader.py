"""Resume: choose a checkpoint, verify it, load it, at any world size.

Every rank takes part: rank 0 scans the location and shares what it found, so all ranks
try the same checkpoints in the same order. A checkpoint is used only when every rank
found its files intact (sizes and SHA-256; from an object store, the shard files' pieces
its load reads, `ranged.py`); a damaged one is skipped with a warning and the previous
one is tried.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from rlft.trainer.checkpoint import rng
from rlft.trainer.checkpoint.catalog import Catalog, Scan
from rlft.trainer.checkpoint.errors import (
    BucketMissingError,
    CredentialsError,
    ForeignCheckpointError,
    StorageError,
    StorageFullError,
)
from rlft.trainer.checkpoint.manifest import EXTRA, Manifest, parse_which, problems_with
from rlft.trainer.checkpoint.ranged import (
    MODULE_NEEDS,
    BlockReader,
    Blocks,
    damage_in,
    foreign_in,
    missing_module,
    resume_copy_failure,
    storage_failure,
)
from rlft.trainer.checkpoint.saver import RANKS
from rlft.trainer.checkpoint.state import Modules, apply_tensor_state, tensor_state
from rlft.trainer.storage.backends import FileStorage, Storage, sha256_file
from rlft.trainer.storage.retry import with_retries
from rlft.trainer.telemetry import liveness

log = logging.getLogger("rlft.checkpoint")


@dataclass
class Resumed:
    """What a resume restored, besides the model and optimizer."""

    manifest: Manifest
    uri: str
    """The checkpoint folder's URI."""
    extra: dict[str, Any]
    """The `extra` dict given to save() (rank 0's run state)."""
    rank_state: dict[str, Any] | None
    """This rank's `rank_state`; None when the world size changed."""
    rng_restored: bool
    """Whether this rank's RNG states were restored (same world size only)."""

    @property
    def step(self) -> int:
        return self.manifest.step


RESUME_RETRY_S = 900.0
"""How long a resume retries reads the store refuses for a while (the default of
spec.checkpoint.uploadRetryMinutes, which a job's resume uses)."""


class LocalCopy:
    """A checkpoint folder readable by DCP on this machine: the folder itself on
    file://, a verified download elsewhere (removed by `cleanup`)."""

    def __init__(
        self,
        storage: Storage,
        cache_dir: Path | None,
        rank: int,
        world_size: int,
        retry_s: float = RESUME_RETRY_S,
    ):
        self.storage = storage
        self.rank = rank
        self.world_size = world_size
        self.retry_s = retry_s
        self.cache = cache_dir or Path(tempfile.mkdtemp(prefix="rlft-resume-"))
        self.owned = cache_dir is None
        self.path: Path | None = None
        self.blocks: Blocks | None = None
        """The shard files fetched piece by piece as DCP reads them (a download)."""

    def fetch(self, manifest: Manifest) -> list[str]:
        """Make the checkpoint readable at `self.path`; the problems found (empty: ok).
        On file:// the ranks split the checksum work; downloads are checked in full."""
        if isinstance(self.storage, FileStorage):
            self.blocks = None
            self.path = self.storage.root / manifest.folder
            mine = manifest.files[self.rank :: self.world_size]
            found = {}
            for entry in mine:
                liveness.beat(f"checking {manifest.folder}/{entry.path}")
                file = self.path / entry.path
                if file.is_file():
                    found[entry.path] = sha256_file(file)
            subset = dataclasses.replace(manifest, files=mine)
            return problems_with(subset, found)
        self.cleanup_download()
        self.path = self.cache / f"rank-{self.rank}" / manifest.folder
        shutil.rmtree(self.path, ignore_errors=True)
        self.blocks = Blocks(self.storage, manifest, self.path, self.retry_s)
        found: dict[str, tuple[int, str | None]] = {}
        for entry in manifest.files:
            if entry.path in self.blocks.entries:
                found[entry.path] = (entry.size, None)  # its pieces are checked as read
                continue
            target = self.path / entry.path
            key = f"{manifest.folder}/{entry.path}"
            # Progress, file by file (a rollback's restore runs inside the judged loop).
            liveness.beat(f"downloading {key}")
            try:
                with_retries(
                    lambda key=key, target=target: self.storage.get_file(key, target),
                    deadline_s=self.retry_s,
                )
            except (BucketMissingError, CredentialsError):
                raise  # the location's trouble, not this checkpoint's: every one would fail
            except StorageFullError as error:  # this disk's trouble, not the checkpoint's
                raise resume_copy_failure(error, self.cache) from None
            except StorageError as error:
                if error.transient:
                    raise
                continue
            found[entry.path] = sha256_file(target)
        self.blocks.prepare()
        return problems_with(manifest, found)

    def read(self, state: dict[str, Any], process_group: Any = None) -> list[str]:
        """Load `state` from the fetched checkpoint (DCP: each rank reads its part, with
        `process_group` when distributed); the shard pieces found missing or corrupted
        on any rank (empty: loaded). Every rank gets the same answer."""
        assert self.path is not None
        distributed = dist.is_available() and dist.is_initialized()
        reader = BlockReader(self.path, self.blocks) if self.blocks is not None else None
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    state,
                    checkpoint_id=None if reader else str(self.path),
                    storage_reader=reader,
                    process_group=process_group,
                    no_dist=not distributed,
                )
        except CheckpointException as error:  # each rank's failures, on every rank
            if damage := damage_in(error):
                return damage
            if foreign := foreign_in(error):
                if module := missing_module(foreign):
                    raise ForeignCheckpointError(
                        f"{self.storage.uri}/{self.path.name} was written by a run of this "
                        f"job without the {module} model it now has: {MODULE_NEEDS[module]} "
                        "cannot be added to a run under way. Set the job back as it was "
                        "when it started, or run the change as a new job (a checkpoint "
                        "location of its own)"
                    ) from None
                raise ForeignCheckpointError(
                    f"{self.storage.uri}/{self.path.name} holds another model's checkpoint "
                    f"({foreign}): give this job its own checkpoint location (or --out), or "
                    "start afresh over it with --overwrite"
                ) from None
            raise storage_failure(error) or error from None
        return []

    def cleanup_download(self) -> None:
        if not isinstance(self.storage, FileStorage) and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def cleanup(self) -> None:
        self.cleanup_download()
        if self.owned:
            shutil.rmtree(self.cache, ignore_errors=True)


def _every_ranks(problems: list[str], group: Any) -> list[str]:
    """The problems every rank found (on file:// each checks its share of the files), so
    that all ranks decide alike and name the same files."""
    if not (dist.is_available() and dist.is_initialized()):
        return problems
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    return list(dict.fromkeys(p for found in gathered for p in found or []))


def shared_scan(catalog: Catalog, group: Any = None, retry_s: float = RESUME_RETRY_S) -> Scan:
    """Rank 0's scan of the location, on every rank (retried while the store is down)."""
    if not (dist.is_available() and dist.is_initialized()):
        return with_retries(catalog.scan, deadline_s=retry_s)
    box = [with_retries(catalog.scan, deadline_s=retry_s) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def load(
    storage: Storage,
    which: str | int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: Any = None,
    cache_dir: Path | None = None,
    restore_rng: bool = True,
    modules: Modules | None = None,
    job_uid: str | None = None,
    retry_s: float = RESUME_RETRY_S,
) -> Resumed:
    """Restore model and optimizer (and this rank's RNG states) from the checkpoint that
    `which` selects (`auto`, `latest-healthy` or a step); returns the rest of the state.

    Call on every rank after the model is built (and wrapped with FSDP2, if it is) and
    the optimizer created. NoCheckpointError when nothing intact matches. A group other
    than the default one can be passed (it must have a CPU backend). With `job_uid`, the
    checkpoints of other jobs (another job uid in their manifest) are not candidates.
    Reads the store refuses for a while (a transient error: down, throttling) are retried
    for `retry_s`: an outage stalls a (re)start instead of ending it.
    """
    which = parse_which(which)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    catalog = Catalog(storage)
    local = LocalCopy(storage, cache_dir, rank, world_size, retry_s)

    states: list[dict[str, Any]] = []

    def check(manifest: Manifest) -> list[str]:
        """Intact when every rank's files check and its load reads only intact pieces
        (the state of a checkpoint found damaged is loaded again from the next)."""
        if problems := _every_ranks(local.fetch(manifest), process_group):
            return problems
        if not states:  # only once there is one to load: it fills the optimizer's state
            states.append(tensor_state(model, optimizer, modules))
        return local.read(states[0], process_group)

    try:
        scan = shared_scan(catalog, process_group, retry_s)
        if job_uid is not None:
            scan = scan.without_other_jobs(job_uid)
        manifest = catalog.choose(which, check=check, scan=scan)
        assert local.path is not None
        apply_tensor_state(model, optimizer, states[0], modules)
        extra = json.loads((local.path / EXTRA).read_text())
        ranks = json.loads((local.path / RANKS).read_text())
    finally:
        local.cleanup()
    same_world = len(ranks) == world_size
    if restore_rng and same_world:
        rng.restore(ranks[rank]["rng"])
    elif not same_world and rank == 0:
        log.warning(
            "resuming step %d saved at world size %d on %d ranks: model and optimizer are "
            "resharded; per-rank RNG streams and rank_state start fresh",
            manifest.step,
            len(ranks),
            world_size,
        )
    return Resumed(
        manifest=manifest,
        uri=f"{storage.uri}/{manifest.folder}",
        extra=extra,
        rank_state=ranks[rank]["state"] if same_world else None,
        rng_restored=bool(restore_rng and same_world),
    )
