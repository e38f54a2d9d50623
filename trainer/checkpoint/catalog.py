"""The checkpoints stored at one location: scan, verify, commit, choose, prune.

A thin I/O layer over a Storage; the decisions themselves live in manifest.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rlft.trainer.checkpoint.errors import (
    CheckpointError,
    DamagedCheckpointsError,
    ManifestError,
    NewerFormatError,
    NoCheckpointError,
    ObjectMissingError,
    StorageError,
)
from rlft.trainer.checkpoint.manifest import (
    EXTRA,
    LATEST,
    MANIFEST,
    Manifest,
    Which,
    off_timeline,
    parse_step_dir,
    problems_with,
    resume_order,
    retention_plan,
    step_dir,
    timeline_head,
)
from rlft.trainer.storage.backends import CHUNK, Storage

log = logging.getLogger("rlft.checkpoint")


@dataclass
class Scan:
    """What a location holds."""

    manifests: dict[int, Manifest] = field(default_factory=dict)
    """Committed checkpoints by step."""
    unreadable: dict[int, str] = field(default_factory=dict)
    """Folders whose manifest exists but cannot be parsed (damaged), with the reason."""
    newer: set[int] = field(default_factory=set)
    """Those of `unreadable` written by a newer rlft: not damaged, never deleted here."""
    uncommitted: set[int] = field(default_factory=set)
    """Folders without a manifest: interrupted or in-flight saves."""
    latest: int | None = None
    """The step the `latest` pointer names."""
    vanished: set[int] = field(default_factory=set)
    """Folders whose manifest was listed but deleted before it was read (the retention
    of a run writing there): in none of the sets above."""

    @property
    def committed(self) -> dict[int, bool]:
        return {step: m.healthy for step, m in self.manifests.items()}

    @property
    def parents(self) -> dict[int, int | None]:
        """Each committed step's parent (`Manifest.parent`): what gives the timeline."""
        return {step: m.parent for step, m in self.manifests.items()}

    @property
    def abandoned(self) -> set[int]:
        """Committed steps off the timeline `latest` names (above it, or between the
        links of its chain): never resumed by the pointer, deleted by retention."""
        head = timeline_head(self.manifests, self.latest)
        if head is None:
            return set()
        above = {s for s in self.manifests if s > head}
        return above | off_timeline(self.parents, head)

    def own(self, job_uid: str) -> dict[int, Manifest]:
        """The committed checkpoints `job_uid` wrote."""
        return {step: m for step, m in self.manifests.items() if m.job_uid == job_uid}

    def without_other_jobs(self, job_uid: str) -> Scan:
        """This scan without the committed checkpoints another job wrote (those of no
        known job stay: written locally, or by an rlft before job uids)."""
        kept = {s: m for s, m in self.manifests.items() if m.job_uid in (None, job_uid)}
        return replace(self, manifests=kept)


RESUME_ADVICE = (
    "restore or delete the damaged folders (a location without checkpoints starts the job "
    "afresh), or give the job another checkpoint location"
)
RESCANS = 3
"""Scans again of a location whose checkpoints were all deleted while checked (a run
writing there commits and prunes faster than they are read)."""
STEP_ADVICE = (
    "restore that folder, or resume another step (`rlft checkpoints verify` checks them; "
    "`--resume auto` takes the newest intact one)"
)


class Catalog:
    """Checkpoints at one Storage location."""

    def __init__(self, storage: Storage):
        self.storage = storage

    def read_latest(self) -> int | None:
        try:
            text = self.storage.get_bytes(LATEST).decode(errors="replace").strip()
        except ObjectMissingError:
            return None
        step = parse_step_dir(text)
        if step is None:
            log.warning(
                "%s/%s holds %r, not a checkpoint folder: ignored",
                self.storage.uri,
                LATEST,
                text[:80],
            )
        return step

    def scan(self) -> Scan:
        scan = Scan(latest=self.read_latest())
        folders: dict[int, set[str]] = {}
        # Not the whole location: beside the step folders lie the metrics history's
        # segments (one per checkpoint, never pruned) and the outputs.
        for info in self.storage.list("step-"):
            head, _, rest = info.key.partition("/")
            step = parse_step_dir(head)
            if step is not None and rest:
                folders.setdefault(step, set()).add(rest)
        for step, names in folders.items():
            if MANIFEST not in names:
                scan.uncommitted.add(step)
                continue
            self._read_manifest(step, scan)
        return scan

    def _read_manifest(self, step: int, scan: Scan) -> None:
        """Add the listed manifest of `step` to `scan` (to `vanished` when it went since
        the listing: the retention of a run writing here deletes manifests first)."""
        where = f"{self.storage.uri}/{step_dir(step)}/{MANIFEST}"
        try:
            manifest = Manifest.from_json(
                self.storage.get_bytes(f"{step_dir(step)}/{MANIFEST}"), where
            )
            if manifest.step != step:
                raise ManifestError(f"{where}: says step {manifest.step}")
            scan.manifests[step] = manifest
        except ObjectMissingError:
            scan.vanished.add(step)
        except ManifestError as error:
            scan.unreadable[step] = str(error)
            if isinstance(error, NewerFormatError):
                scan.newer.add(step)

    def verify(self, manifest: Manifest, *, checksums: bool = True) -> list[str]:
        """Problems with a committed checkpoint's files (empty: intact). Without
        `checksums` only presence and sizes are checked (one listing, no reads). A file
        deleted while checked is missing; `gone` tells whether retention deleted it."""
        folder = manifest.folder
        listed = {
            info.key[len(folder) + 1 :]: info.size for info in self.storage.list(f"{folder}/")
        }
        found: dict[str, tuple[int, str | None]] = {}
        for entry in manifest.files:
            if entry.path not in listed:
                continue
            if not checksums or listed[entry.path] != entry.size:
                found[entry.path] = (listed[entry.path], None)
                continue
            try:
                found[entry.path] = (entry.size, self._sha256(f"{folder}/{entry.path}"))
            except ObjectMissingError:
                continue
        return problems_with(manifest, found)

    def _sha256(self, key: str) -> str:
        digest = hashlib.sha256()
        with self.storage.open_read(key) as stream:
            while chunk := stream.read(CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def gone(self, manifest: Manifest) -> bool:
        """Whether a checkpoint found with missing files was deleted since it was listed
        (not damaged): its manifest is gone too. Retention, and a save withdrawing an old
        manifest of its step, delete the manifest before the files. A store that does
        not answer: not known to be gone."""
        try:
            return not self.storage.exists(f"{manifest.folder}/{MANIFEST}")
        except StorageError:
            return False

    def choose(
        self,
        which: Which,
        check: Callable[[Manifest], list[str]] | None = None,
        scan: Scan | None = None,
        purpose: str | None = None,
        advice: str | None = None,
    ) -> Manifest:
        """The checkpoint a resume takes: the first in resume order that `check` (default:
        full checksum verification) finds intact. Each damaged one is skipped with a
        warning naming it and why; when all are, DamagedCheckpointsError (none at all:
        NoCheckpointError), its message naming `purpose` (default: the resume) and
        ending with `advice`. One deleted while checked (the retention of a run writing
        here) is skipped as gone, not damaged; when that leaves none and the scan was
        this call's own, the location is scanned again (retention made room for a newer
        commit)."""
        check = check or self.verify
        rescans = RESCANS if scan is None else 0
        while True:
            current = scan or self.scan()
            self._refuse_newer(which, current)
            found, damaged, gone = self._first_intact(which, current, check)
            if found is not None:
                return found
            if not (gone or current.vanished) or rescans == 0:
                raise self._none_usable(which, current, damaged, purpose, advice)
            rescans -= 1

    def _refuse_newer(self, which: Which, scan: Scan) -> None:
        if isinstance(which, int):
            newer = sorted({which} & scan.newer)
        else:  # those a resume would otherwise pass over: above every readable one
            top = max(scan.manifests, default=-1)
            newer = sorted(s for s in scan.newer if s > top or s == scan.latest)
        if newer:
            # Falling back past them would train on, and the next commit would move
            # `latest` below them: a downgrade must not cost the newer run's steps.
            raise NewerFormatError(
                f"{self.storage.uri} holds checkpoints written by a newer rlft "
                f"({', '.join(step_dir(s) for s in newer)}): upgrade rlft, or name an "
                "older step with --resume, or give the job another checkpoint location"
            )

    def _first_intact(
        self, which: Which, scan: Scan, check: Callable[[Manifest], list[str]]
    ) -> tuple[Manifest | None, dict[int, str], set[int]]:
        """The first intact checkpoint in resume order (None: none), the damaged ones
        before it with their problems, and those deleted while checked."""
        order = resume_order(scan.committed, scan.latest, which, scan.parents)
        for step, reason in sorted(scan.unreadable.items(), reverse=True):
            log.warning(
                "checkpoint %s/%s is damaged and skipped: %s",
                self.storage.uri,
                step_dir(step),
                reason,
            )
        damaged: dict[int, str] = {}
        gone: set[int] = set()
        for position, step in enumerate(order, 1):
            manifest = scan.manifests[step]
            problems = check(manifest)
            if not problems:
                return manifest, damaged, gone
            if self.gone(manifest):
                gone.add(step)
                log.info("checkpoint %s/%s was deleted meanwhile", self.storage.uri, step_dir(step))
                continue
            damaged[step] = "; ".join(problems[:3]) + (" …" if len(problems) > 3 else "")
            log.warning(
                "checkpoint %s/%s is damaged (%s)%s",
                self.storage.uri,
                step_dir(step),
                damaged[step],
                "; falling back to the previous one" if position < len(order) else "",
            )
        return None, damaged, gone

    def _none_usable(
        self,
        which: Which,
        scan: Scan,
        damaged: dict[int, str],
        purpose: str | None,
        advice: str | None,
    ) -> CheckpointError:
        """The error of a choice that found nothing intact."""
        if not isinstance(which, int):
            # An unreadable manifest may be the checkpoint asked for (healthy or newest).
            damaged = damaged | scan.unreadable
        elif which in scan.unreadable:
            damaged = damaged | {which: scan.unreadable[which]}
        wanted = purpose or f"--resume={which}"
        if damaged:
            found = "; ".join(f"{step_dir(s)}: {why}" for s, why in sorted(damaged.items()))
            return DamagedCheckpointsError(
                f"no usable checkpoint for {wanted} at {self.storage.uri} ({found}). Nothing "
                "was changed there: "
                + (advice or (STEP_ADVICE if isinstance(which, int) else RESUME_ADVICE)),
                found,
            )
        available = ", ".join(str(s) for s in sorted(scan.manifests)) or "none"
        return NoCheckpointError(
            f"no intact checkpoint for {wanted} at {self.storage.uri} "
            f"(committed steps: {available})"
        )

    def commit(self, manifest: Manifest) -> None:
        """Write the manifest (the commit), then move the `latest` pointer to it."""
        self.storage.put_bytes(f"{manifest.folder}/{MANIFEST}", manifest.to_json().encode())
        self.storage.put_bytes(LATEST, f"{manifest.folder}\n".encode())

    def read_extra(self, step: int) -> dict:
        """The `extra.json` of a committed checkpoint (the run state it holds), without
        loading its tensors. StorageError, or ValueError when it is not a JSON object."""
        extra = json.loads(self.storage.get_bytes(f"{step_dir(step)}/{EXTRA}"))
        if not isinstance(extra, dict):
            raise ValueError(f"{self.storage.uri}/{step_dir(step)}/{EXTRA}: not a JSON object")
        return extra

    def point_at(self, step: int) -> None:
        """Move the `latest` pointer to the committed checkpoint of `step` (a rollback
        to it: a restart must not resume the timeline it escaped)."""
        self.storage.put_bytes(LATEST, f"{step_dir(step)}\n".encode())

    def prune(self, keep_last: int) -> set[int]:
        """Apply retention after a commit; returns the steps deleted. Failures are logged,
        not raised: a missed deletion is retried after the next commit."""
        try:
            scan = self.scan()
            leftovers = scan.uncommitted | (set(scan.unreadable) - scan.newer)
            # Steps off the timeline go only where the job that wrote `latest` wrote them
            # too: another job's at a shared location are not its to delete.
            head = scan.manifests.get(scan.latest) if scan.latest is not None else None
            uid = head.job_uid if head is not None else None
            parents = {s: m.parent for s, m in scan.manifests.items() if m.job_uid == uid}
            doomed = retention_plan(scan.committed, leftovers, scan.latest, keep_last, parents)
            for step in sorted(doomed):
                # The manifest goes first, so a half-deleted folder is never "committed".
                if step in scan.manifests:
                    self.storage.delete_prefix(f"{step_dir(step)}/{MANIFEST}")
                self.storage.delete_prefix(f"{step_dir(step)}/")
        except (StorageError, CheckpointError) as error:
            log.warning(
                "checkpoint retention at %s failed (retried later): %s", self.storage.uri, error
            )
            return set()
        return doomed
