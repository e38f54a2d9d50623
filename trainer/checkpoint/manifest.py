"""The checkpoint layout and its pure decisions: manifests, resume choice, retention.

Layout under the checkpoint URI (docs/architecture.md, "Contracts"):

    step-000120/               one folder per checkpoint
        .metadata, __0_0.distcp, __1_0.distcp, …   DCP shards (each rank writes its own)
        extra.json             the caller's state (step, cursors, schedules, job config…)
        ranks.json             every rank's RNG states and rank_state
        hf/config.json, hf/tokenizer.json, …       what `rlft export` needs
        manifest.json          written LAST: the commit
    latest                     names the newest committed folder (moves after a commit)

A checkpoint without a manifest does not exist. Everything here is plain data, so the
rules (which checkpoint a resume takes, what retention deletes) are tested exhaustively.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse

from rlft.trainer.checkpoint.errors import ManifestError, NewerFormatError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
EXTRA = "extra.json"
HF_DIR = "hf"
OUTPUTS = "outputs"
"""Beside the step folders: a finished run's final model, metrics.jsonl and summary.json."""
FRESH_START = -1
"""The parent of a run's first checkpoint when it started from none: nothing older at
its location is its past (`--overwrite`, a paused run with no healthy checkpoint)."""
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(step: int) -> str:
    """The folder of a step: `step-000120` (zero-padded so names sort by step)."""
    if step < 0:
        raise ValueError("a checkpoint step is ≥ 0")
    return f"step-{step:06d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a checkpoint folder name, None for anything else."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def config_hash(config: Any) -> str:
    """A stable hash of the job config (canonical JSON), to tell runs apart."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint, relative to its folder."""

    path: str
    size: int
    sha256: str
    blocks: tuple[str, ...] = ()
    """SHA-256 of each `Manifest.block_bytes` piece of a shard file (the last may be
    shorter): a resume downloads, and checks, only the pieces its rank reads."""


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint."""

    step: int
    policy_version: int
    world_size: int
    config_hash: str
    healthy: bool
    files: tuple[FileEntry, ...]
    created_at: str = field(default_factory=now_iso)
    emergency: bool = False
    """Written on SIGTERM rather than on schedule."""
    job_uid: str | None = None
    """The RLFineTune's metadata.uid when the operator ran the job (RLFT_JOB_UID): which
    checkpoints at a location are the job's own (see `resume: never`)."""
    format_version: int = FORMAT_VERSION
    block_bytes: int = 0
    """Length of the pieces `FileEntry.blocks` hash (0: files are checked whole)."""
    parent: int | None = None
    """The committed checkpoint this one's weights descend from: the run's previous
    commit, or the step it resumed from or rolled back to (`FRESH_START` when the run
    started from none; None: written by an rlft that did not record it). Following
    parents from `latest` gives the timeline; the steps between them are another's
    (`off_timeline`)."""

    @property
    def folder(self) -> str:
        return step_dir(self.step)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    def to_json(self) -> str:
        data = asdict(self)
        document = {
            "formatVersion": data["format_version"],
            "step": self.step,
            "policyVersion": self.policy_version,
            "worldSize": self.world_size,
            "configHash": self.config_hash,
            "healthy": self.healthy,
            "emergency": self.emergency,
            **({"jobUid": self.job_uid} if self.job_uid else {}),
            "createdAt": self.created_at,
            **({"blockBytes": self.block_bytes} if self.block_bytes else {}),
            **({"parent": self.parent} if self.parent is not None else {}),
            "files": [_entry_json(entry) for entry in self.files],
        }
        return json.dumps(document, indent=1) + "\n"

    @staticmethod
    def from_json(text: str | bytes, where: str) -> Manifest:
        """Parse a manifest; ManifestError naming `where` for anything malformed."""
        try:
            doc = json.loads(text)
            version = doc["formatVersion"]
            if version > FORMAT_VERSION:
                raise NewerFormatError(
                    f"{where}: format version {version} is newer than this rlft understands "
                    f"({FORMAT_VERSION}); upgrade rlft"
                )
            files = tuple(
                FileEntry(
                    str(f["path"]),
                    int(f["size"]),
                    str(f["sha256"]),
                    tuple(str(b) for b in f.get("blocks", ())),
                )
                for f in doc["files"]
            )
            manifest = Manifest(
                step=int(doc["step"]),
                policy_version=int(doc["policyVersion"]),
                world_size=int(doc["worldSize"]),
                config_hash=str(doc["configHash"]),
                healthy=bool(doc["healthy"]),
                files=files,
                created_at=str(doc["createdAt"]),
                emergency=bool(doc.get("emergency", False)),
                job_uid=str(doc["jobUid"]) if doc.get("jobUid") else None,
                format_version=int(version),
                block_bytes=int(doc.get("blockBytes", 0)),
                parent=None if doc.get("parent") is None else int(doc["parent"]),
            )
            for f in files:
                if f.blocks and len(f.blocks) != block_count(f.size, manifest.block_bytes):
                    raise ValueError(
                        f"{f.path}: {len(f.blocks)} block checksums for {f.size} bytes"
                    )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as error:
            raise ManifestError(f"{where}: not a valid manifest ({error!r})") from None
        return manifest


def block_count(size: int, block_bytes: int) -> int:
    """Pieces of `block_bytes` (the last may be shorter) a file of `size` bytes has."""
    if block_bytes <= 0:
        raise ValueError("blockBytes must be positive where files list block checksums")
    return max(1, -(-size // block_bytes))


def _entry_json(entry: FileEntry) -> dict[str, Any]:
    data = asdict(entry)
    if not entry.blocks:
        del data["blocks"]
    else:
        data["blocks"] = list(entry.blocks)
    return data


def problems_with(manifest: Manifest, found: dict[str, tuple[int, str | None]]) -> list[str]:
    """What is wrong with a checkpoint's files: `found` maps each path to its size and
    SHA-256 (None when only the size was checked)."""
    problems = []
    for entry in manifest.files:
        if entry.path not in found:
            problems.append(f"{entry.path}: missing")
            continue
        size, digest = found[entry.path]
        if size != entry.size:
            problems.append(f"{entry.path}: {size} bytes, the manifest says {entry.size}")
        elif digest is not None and digest != entry.sha256:
            problems.append(f"{entry.path}: checksum mismatch (corrupted)")
    return problems


# -------------------------------------------------------------------------- resume


Which = str | int
"""`auto`, `latest-healthy`, or a step number."""


def split_location(location: str) -> tuple[str, Which]:
    """`…/step-000120` names one checkpoint; anything else is a location (→ auto)."""
    parsed = urlparse(location) if "://" in location else None
    path = parsed.path if parsed else location
    head, _, tail = path.rstrip("/").rpartition("/")
    step = parse_step_dir(tail)
    if step is None:
        return location, "auto"
    base = parsed._replace(path=head).geturl() if parsed else (head or ".")
    return base, step


def parse_which(text: str | int) -> Which:
    """Validate a --resume value."""
    if isinstance(text, int) or (isinstance(text, str) and text.isdigit()):
        return int(text)
    if text in ("auto", "latest", "latest-healthy"):
        return "auto" if text == "latest" else text
    raise ValueError(f"--resume must be auto, latest-healthy or a step number, not {text!r}")


def off_timeline(parents: dict[int, int | None], ceiling: int | None) -> set[int]:
    """Committed steps below `ceiling` that are not its past: those between the links of
    its chain of parents (a `--resume 50` that committed 60 leaves the old timeline's 55;
    a rollback to 50 that committed 51 leaves the 55 and 60 it escaped). `parents` maps
    each committed step to its manifest's parent.

    Below where the chain ends, the lineage is unknown and every step is taken as the
    timeline's: a parent deleted by retention or unreadable (its own parent is not
    known), or a manifest with no parent (an older rlft's). Below `FRESH_START` there is
    nothing, so every step not in the chain is another timeline's.
    """
    if ceiling is None or ceiling not in parents:
        return set()
    chain = {ceiling}
    step = ceiling
    while (parent := parents.get(step)) is not None and parent < step and parent in parents:
        chain.add(parent)
        step = parent
    parent = parents[step]
    floor = parent if parent is not None and parent < step else step
    return {s for s in parents if floor < s < ceiling and s not in chain}


def timeline_head(committed: Iterable[int], latest: int | None) -> int | None:
    """The newest commit of the timeline the pointer names: `latest` itself, or with no
    pointer (a crash between the first manifest and the pointer) or a dangling one, the
    newest committed step not above it."""
    steps = set(committed)
    if latest is not None and latest in steps:
        return latest
    return max((s for s in steps if latest is None or s <= latest), default=None)


def resume_order(
    committed: dict[int, bool],
    latest: int | None,
    which: Which,
    parents: dict[int, int | None] | None = None,
) -> list[int]:
    """Checkpoints to try for a resume, best first (later ones are the fallbacks when an
    earlier one turns out damaged).

    `committed` maps step → healthy; `latest` is the step the pointer names. The pointer
    defines the current timeline: after a rollback to step 100, a later commit at 110
    moves it there, and folders above it (the abandoned 120) are never resumed; nor,
    given `parents` (step → its manifest's parent), those below it that are not its
    past (`off_timeline`).
    """
    ceiling = timeline_head(committed, latest)
    if ceiling is None:
        return []
    abandoned = off_timeline(parents or {}, ceiling)
    steps = sorted((s for s in committed if s <= ceiling and s not in abandoned), reverse=True)
    if which == "auto":
        return steps
    if which == "latest-healthy":
        return [s for s in steps if committed[s]]
    if isinstance(which, int):
        # An explicit step is that checkpoint and no other, on the timeline or off it
        # (the user, or a rollback, asked for it by name): damaged, it is an error, not a
        # reason to load an older one the caller did not choose (an unhealthy one, say).
        return [which] if which in committed else []
    raise ValueError(f"unknown resume choice {which!r}")


# ----------------------------------------------------------------------- retention


def retention_plan(
    committed: dict[int, bool],
    uncommitted: set[int],
    latest: int | None,
    keep_last: int,
    parents: dict[int, int | None] | None = None,
) -> set[int]:
    """Steps whose folders retention deletes, right after `latest` was committed.

    Kept, on the timeline (up to `latest`): the newest `keep_last` committed checkpoints,
    the newest `keep_last` healthy ones (what a resume with latest-healthy and a
    collapse rollback restore, with as many fallbacks), and always `latest` itself: at
    most 2·keep_last + 1. Every healthy one was kept before, and a long healthy run's
    storage grew without bound. Deleted: older committed ones beyond those, committed
    ones off the timeline (above `latest`, or given `parents` between the links of its
    chain: `off_timeline`), and uncommitted leftovers (interrupted saves) below `latest`.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be ≥ 1")
    if latest is None:
        return set()
    abandoned = off_timeline(parents or {}, latest)
    timeline = sorted((s for s in committed if s <= latest and s not in abandoned), reverse=True)
    healthy = [s for s in timeline if committed[s]]
    keep = set(timeline[:keep_last]) | set(healthy[:keep_last]) | {latest}
    doomed = {s for s in committed if s not in keep}
    doomed |= {s for s in uncommitted if s < latest and s not in committed}
    return doomed
