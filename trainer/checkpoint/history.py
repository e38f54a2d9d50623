"""metrics.jsonl's history, kept with the checkpoints so that a run resumed in a new
output folder (a replaced pod) has every step's line once.

Each checkpoint used to hold the whole file in its `extra.json`: on a long run every
save wrote, hashed and uploaded a copy growing with the run (4.9 MB at step 4,000 of a
tiny job, against a 1.1 MB model), and the trainer's memory grew with it (about 25 KB a
step, none without checkpoints). Now each save uploads only the lines appended since the
last committed checkpoint, as one segment under `metrics/` beside the step folders, and
its `extra.json` lists the segments (key and SHA-256) that make the file up to it. The
segments are never pruned: later checkpoints list their predecessors' (their total is
the file's size). A save that did not commit leaves its segment unlisted; the next one
covers its lines again.

Rank 0 only: it writes metrics.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlft.trainer.checkpoint.manifest import step_dir
from rlft.trainer.storage.backends import Storage
from rlft.trainer.storage.errors import StorageError
from rlft.trainer.storage.retry import with_retries

SEGMENTS = "metrics_segments"
"""The key in a checkpoint's extra listing its history's segments."""
WHOLE = "metrics"
"""The key of the whole history (lines), in checkpoints from before segments."""
PREFIX = "metrics"


@dataclass(frozen=True)
class Covered:
    """What a checkpoint's segments hold: the first `size` bytes of metrics.jsonl."""

    segments: tuple[dict[str, str], ...] = ()
    size: int = 0


class MetricsHistory:
    """metrics.jsonl at `path` against the segments of the newest committed checkpoint."""

    def __init__(self, storage: Storage, path: Path, retry_s: float = 0.0):
        self.storage = storage
        self.path = path
        self.retry_s = retry_s
        """How long a segment the store refuses to read is retried (as the checkpoint)."""
        self.committed = Covered()
        self._pending: tuple[int, Covered] | None = None

    def restore(self, extra: dict[str, Any], step: int, warn: Callable[[str], None]) -> None:
        """Write metrics.jsonl as it was when the checkpoint of `step` was saved."""
        self._pending = None
        if SEGMENTS in extra:
            # One segment in memory at a time: a weeks-long run's whole history is
            # gigabytes, more than a restarted trainer may hold at once.
            size = 0
            restoring = self.path.with_name(f".{self.path.name}.restoring")
            with restoring.open("wb") as file:
                for segment in extra[SEGMENTS]:
                    size += file.write(self._fetch(segment, warn))
            restoring.replace(self.path)  # the local file as it was until the whole is here
            self.committed = Covered(tuple(extra[SEGMENTS]), size)
            return
        if WHOLE in extra:
            lines = extra[WHOLE]
        else:  # a checkpoint with no history of its own: the local file, cut at `step`
            local = self.path.read_text().splitlines() if self.path.exists() else []
            steps = [(line, _step(line)) for line in local]
            lines = [line for line, at in steps if at is not None and at <= step]
        self.path.write_text("".join(line + "\n" for line in lines))
        self.committed = Covered()  # no segment holds it yet: the next save uploads it all

    def _fetch(self, segment: dict[str, str], warn: Callable[[str], None]) -> bytes:
        key = segment["key"]
        try:
            data = with_retries(lambda: self.storage.get_bytes(key), deadline_s=self.retry_s)
        except StorageError as error:
            warn(f"rlft: warning: metrics history {key} unreadable ({error}); its lines are lost")
            return b""
        if hashlib.sha256(data).hexdigest() != segment["sha256"]:
            warn(f"rlft: warning: metrics history {key} is damaged; its lines are left out")
            return b""
        return data

    def for_save(self, step: int, last_committed: int | None) -> tuple[dict, dict[str, bytes]]:
        """(the extra's entry, {key: bytes} to upload before the commit) for a save of
        `step`; `last_committed` is the newest step the checkpointer committed, which
        tells whether the previous save's segment is part of the history."""
        if self._pending is not None and self._pending[0] == last_committed:
            self.committed = self._pending[1]
        self._pending = None
        new = b""
        if self.path.exists():
            with self.path.open("rb") as file:
                file.seek(self.committed.size)
                new = file.read()
        new = new[: new.rfind(b"\n") + 1]  # whole lines only (one being written waits)
        if not new:
            return {SEGMENTS: list(self.committed.segments)}, {}
        key = f"{PREFIX}/{step_dir(step)}-{uuid.uuid4().hex[:8]}.jsonl"
        segment = {"key": key, "sha256": hashlib.sha256(new).hexdigest()}
        covered = Covered((*self.committed.segments, segment), self.committed.size + len(new))
        self._pending = (step, covered)
        return {SEGMENTS: list(covered.segments)}, {key: new}


def _step(line: str) -> int | None:
    """The step of a metrics line; None for one cut short (a run killed mid-write)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def segment_problems(storage: Storage, extra: dict[str, Any]) -> list[str]:
    """What is wrong with the history segments a checkpoint's extra lists (empty: each
    is there, with its SHA-256): they live outside the step folder and its manifest."""
    problems = []
    for segment in extra.get(SEGMENTS, []):
        try:
            data = storage.get_bytes(segment["key"])
        except StorageError as error:
            problems.append(f"history {segment['key']}: unreadable ({error})")
            continue
        if hashlib.sha256(data).hexdigest() != segment["sha256"]:
            problems.append(f"history {segment['key']}: SHA-256 differs")
    return problems
