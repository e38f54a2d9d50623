"""metrics.jsonl's history, kept with the checkpoints so that a run resumed in a new
output folder (a replaced pod) has every step's line once.

Each checkpoint used to hold the whole file in its `extra.json`: on a long run every
save wrote, hashed and uploaded a copy growing with the run (4.9 MB at step 4,000 of a
tiny job, against a 1.1 MB model), and the trainer's memory grew with it (about 25 KB a
step, none without checkpoints). Now each save uploads only the lines appended since the
last committed checkpoint, as one segment under `metrics/` beside the step folders, and
its `extra.json` lists the segments (key and SHA-256) that make the file up to it. A save
that did not commit leaves its segment unlisted; the next one covers its lines again.

One segment per save kept for good made a weeks-long run's list, and a resume's reads,
grow with its checkpoints (5,000 saves: 5,000 reads before the first resumed step, and
600 KB of list in every `extra.json`). So the list is compacted as a base-`FANOUT`
counter: when the newest `FANOUT` segments cover alike many saves, the save uploads them
as one (its bytes are the local file's, which the list covers byte for byte), up to
`MAX_SEGMENT_BYTES`. A list then holds at most FANOUT−1 segments per power of FANOUT
saves, and each line is uploaded about once per such power. Segments no remaining
checkpoint lists (merged away, or of saves that never committed) are deleted after
retention (`unlisted_segments`).

Rank 0 only: it writes metrics.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlft.trainer.checkpoint.manifest import EXTRA, parse_step_dir, step_dir
from rlft.trainer.storage.backends import Storage
from rlft.trainer.storage.errors import ObjectMissingError, StorageError
from rlft.trainer.storage.retry import with_retries

SEGMENTS = "metrics_segments"
"""The key in a checkpoint's extra listing its history's segments."""
WHOLE = "metrics"
"""The key of the whole history (lines), in checkpoints from before segments."""
log = logging.getLogger("rlft.checkpoint")

PREFIX = "metrics"
FANOUT = 16
"""Segments covering alike many saves that are merged into one."""
MAX_SEGMENT_BYTES = 64 << 20
"""No merge makes a segment larger (a save holds it in memory to upload it)."""
MAX_DELETES = 64
"""Segments one `collect` deletes at most: it runs on the saver's thread before the
commit's verdict reaches the ranks, and the one after retention first deletes the
segments of a run from before compaction (one per save) is spread over later commits."""


@dataclass(frozen=True)
class Covered:
    """What a checkpoint's segments hold: the first `size` bytes of metrics.jsonl."""

    segments: tuple[dict, ...] = ()
    sizes: tuple[int, ...] = ()
    """Bytes of the local file each segment stands for (0 for one lost at the restore)."""

    @property
    def size(self) -> int:
        return sum(self.sizes)


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
            sizes = []
            restoring = self.path.with_name(f".{self.path.name}.restoring")
            with restoring.open("wb") as file:
                for segment in extra[SEGMENTS]:
                    sizes.append(file.write(self._fetch(segment, warn)))
            restoring.replace(self.path)  # the local file as it was until the whole is here
            self.committed = Covered(tuple(extra[SEGMENTS]), tuple(sizes))
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
        committed = self.committed
        tail = b""
        if self.path.exists():
            with self.path.open("rb") as file:
                file.seek(committed.size)
                tail = file.read()
        new = tail.rfind(b"\n") + 1  # whole lines only (one being written waits)
        if not new:
            return {SEGMENTS: list(committed.segments)}, {}
        segments = [*committed.segments, {"saves": 1}]
        sizes = [*committed.sizes, new]
        kept: list[dict] = []
        kept_sizes: list[int] = []
        uploads: dict[str, bytes] = {}
        offset = 0
        for start, end in merge_plan([_saves(s) for s in segments], sizes):
            length = sum(sizes[start:end])
            if end - start == 1 and start < len(committed.segments):
                kept.append(segments[start])
            else:
                # The new lines alone, or merged segments: the local file's bytes they cover.
                fresh = start == len(committed.segments)
                data = tail[:new] if fresh else self._read(offset, length)
                key = f"{PREFIX}/{step_dir(step)}-{uuid.uuid4().hex[:8]}.jsonl"
                saves = sum(_saves(s) for s in segments[start:end])
                digest = hashlib.sha256(data).hexdigest()
                kept.append({"key": key, "sha256": digest, "saves": saves})
                uploads[key] = data
            kept_sizes.append(length)
            offset += length
        covered = Covered(tuple(kept), tuple(kept_sizes))
        self._pending = (step, covered)
        return {SEGMENTS: list(covered.segments)}, uploads

    def _read(self, offset: int, length: int) -> bytes:
        with self.path.open("rb") as file:
            file.seek(offset)
            return file.read(length)

    def collect(self, newest: int) -> list[str]:
        """Delete the segments no checkpoint lists any more (after retention, on the
        saver's thread); the keys deleted. Failures are logged, not raised: what stays
        is deleted after a later commit."""
        try:
            unlisted = unlisted_segments(self.storage, self.in_use(), newest)[:MAX_DELETES]
            for key in unlisted:
                self.storage.delete_prefix(key)
        except StorageError as error:
            log.warning("metrics history segments at %s stay for now: %s", self.storage.uri, error)
            return []
        return unlisted

    def in_use(self) -> set[str]:
        """The segment keys a save may still list: the committed checkpoint's, and the
        pending save's (read from the saver's thread, while the trainer's may save)."""
        pending = self._pending
        keys = {s["key"] for s in self.committed.segments}
        return keys | ({s["key"] for s in pending[1].segments} if pending else set())


def _saves(segment: dict) -> int:
    """How many saves' lines a segment holds (1 in lists from before compaction)."""
    return int(segment.get("saves", 1))


def _level(saves: int) -> int:
    level = 0
    while saves >= FANOUT:
        saves //= FANOUT
        level += 1
    return level


def merge_plan(
    saves: list[int], sizes: list[int], max_bytes: int = MAX_SEGMENT_BYTES
) -> list[tuple[int, int]]:
    """The list's segments grouped into consecutive [start, end) runs, each to become
    one segment: FANOUT neighbours of one level (saves covered, in powers of FANOUT)
    merge, newest first, again until none do. No merge passes `max_bytes`, nor makes the
    merged runs pass it together: a save uploads them, and a long list from before
    compaction is merged over several saves, not read and uploaded whole at one."""
    runs = [(s, b, i, i + 1) for i, (s, b) in enumerate(zip(saves, sizes, strict=True))]

    def merged_bytes() -> int:
        return sum(r[1] for r in runs if r[3] - r[2] > 1)

    merged = True
    while merged:
        merged = False
        for end in range(len(runs), FANOUT - 1, -1):
            window = runs[end - FANOUT : end]
            total = (sum(r[0] for r in window), sum(r[1] for r in window))
            already = sum(r[1] for r in window if r[3] - r[2] > 1)
            if (
                len({_level(r[0]) for r in window}) > 1
                or merged_bytes() - already + total[1] > max_bytes  # this run's bytes too
            ):
                continue
            runs[end - FANOUT : end] = [(*total, window[0][2], window[-1][3])]
            merged = True
            break
    return [(start, end) for _, _, start, end in runs]


def unlisted_segments(storage: Storage, in_use: Iterable[str], newest: int) -> list[str]:
    """Segment keys no step folder's extra.json lists, nor `in_use`, of saves up to step
    `newest`: merged away, or of saves that never committed. A StorageError (or an
    unreadable extra.json) is raised: then nothing is known to be free."""
    listed = set(in_use)
    folders = {i.key.partition("/")[0] for i in storage.list("step-") if i.key.endswith(EXTRA)}
    for folder in sorted(folders):
        try:
            extra = json.loads(storage.get_bytes(f"{folder}/{EXTRA}"))
            listed |= {segment["key"] for segment in extra.get(SEGMENTS, [])}
        except ObjectMissingError:
            continue  # deleted since the listing (retention): it lists nothing now
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise StorageError(f"{folder}/{EXTRA} unreadable: {error!r}") from None
    unlisted = []
    for info in storage.list(f"{PREFIX}/"):
        step = _segment_step(info.key)  # None: not a segment's name; left alone
        if info.key not in listed and step is not None and step <= newest:
            unlisted.append(info.key)
    return unlisted


def _segment_step(key: str) -> int | None:
    """The step of the save that wrote segment `key` (`metrics/step-NNNNNN-xxxxxxxx.jsonl`)."""
    name = key.rpartition("/")[2]
    return parse_step_dir(name.rsplit("-", 1)[0])


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
