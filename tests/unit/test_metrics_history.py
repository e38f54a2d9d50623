"""metrics.jsonl's history kept with the checkpoints as segments: each save uploads the
lines since the last committed checkpoint, not the whole file again (whose copies grew
each checkpoint, and the trainer's memory, with the length of the run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_jobs import arithmetic_rl_spec, write_parity_job

from rlft.trainer.checkpoint.history import SEGMENTS, MetricsHistory
from rlft.trainer.storage.backends import FileStorage
from rlft.trainer.storage.errors import StorageError


def _lines(steps: range) -> str:
    return "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in steps)


def _append(metrics: Path, text: str) -> None:
    with metrics.open("a") as file:
        file.write(text)


@pytest.fixture
def store(tmp_path: Path) -> FileStorage:
    return FileStorage(tmp_path / "checkpoints")


def _save(history: MetricsHistory, store: FileStorage, step: int, committed: int | None) -> dict:
    """What the checkpointer does with a save's history: upload, then list in extra."""
    extra, uploads = history.for_save(step, committed)
    for key, data in uploads.items():
        store.put_bytes(key, data)
    return extra


def test_each_save_uploads_only_the_lines_since_the_last_committed_one(tmp_path, store):
    metrics = tmp_path / "metrics.jsonl"
    history = MetricsHistory(store, metrics)
    metrics.write_text(_lines(range(1, 5)))
    first = _save(history, store, 4, None)
    _append(metrics, _lines(range(5, 9)))
    second = _save(history, store, 8, 4)  # step 4 committed
    assert len(second[SEGMENTS]) == 2 and second[SEGMENTS][0] == first[SEGMENTS][0]
    assert store.get_bytes(second[SEGMENTS][1]["key"]).decode() == _lines(range(5, 9))
    # A replaced pod: a new output folder, the history from the segments.
    elsewhere = tmp_path / "new-pod" / "metrics.jsonl"
    elsewhere.parent.mkdir()
    MetricsHistory(store, elsewhere).restore(second, 8, pytest.fail)
    assert elsewhere.read_text() == _lines(range(1, 9))


def test_a_save_that_did_not_commit_leaves_its_lines_to_the_next(tmp_path, store):
    metrics = tmp_path / "metrics.jsonl"
    history = MetricsHistory(store, metrics)
    metrics.write_text(_lines(range(1, 5)))
    _save(history, store, 4, None)
    with metrics.open("a") as file:
        file.write(_lines(range(5, 9)) + '{"step": 9, "lo')  # step 9's line half written
    extra = _save(history, store, 8, None)  # step 4's save failed
    (segment,) = extra[SEGMENTS]
    assert store.get_bytes(segment["key"]).decode() == _lines(range(1, 9))


def test_a_damaged_or_missing_segment_is_named_and_left_out(tmp_path, store):
    metrics = tmp_path / "metrics.jsonl"
    history = MetricsHistory(store, metrics)
    metrics.write_text(_lines(range(1, 3)))
    _save(history, store, 2, None)
    _append(metrics, _lines(range(3, 5)))
    extra = _save(history, store, 4, 2)
    store.put_bytes(extra[SEGMENTS][0]["key"], b"tampered\n")
    warnings: list[str] = []
    MetricsHistory(store, metrics).restore(extra, 4, warnings.append)
    assert metrics.read_text() == _lines(range(3, 5))
    assert len(warnings) == 1 and "is damaged; its lines are left out" in warnings[0]
    store.delete_prefix(extra[SEGMENTS][1]["key"])
    warnings.clear()
    MetricsHistory(store, metrics).restore(extra, 4, warnings.append)
    assert "unreadable" in warnings[-1] and len(warnings) == 2


def test_a_segment_the_store_refuses_for_a_moment_is_read_again(tmp_path, store):
    """A resume retries a segment as it retries the checkpoint: a 503 cost its lines."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(_lines(range(1, 6)))
    extra = _save(MetricsHistory(store, metrics), store, 5, None)
    refusals = [StorageError("503 Slow Down", transient=True)]
    read = store.get_bytes

    def flaky(key: str) -> bytes:
        if refusals:
            raise refusals.pop()
        return read(key)

    store.get_bytes = flaky  # type: ignore[method-assign]
    elsewhere = tmp_path / "elsewhere.jsonl"
    MetricsHistory(store, elsewhere, retry_s=30).restore(extra, 5, pytest.fail)
    assert elsewhere.read_text() == _lines(range(1, 6)) and not refusals


def test_a_local_file_cut_mid_line_is_restored_without_its_last_line(tmp_path, store):
    """A checkpoint without a history of its own (from before it was kept) keeps the
    local file's lines up to its step; a run killed mid-write left half a line."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(_lines(range(1, 5)) + '{"step": 5, "lo')
    MetricsHistory(store, metrics).restore({}, 3, pytest.fail)
    assert metrics.read_text() == _lines(range(1, 4))


def test_a_checkpoint_from_before_segments_is_restored_and_uploaded_whole_next(tmp_path, store):
    metrics = tmp_path / "metrics.jsonl"
    history = MetricsHistory(store, metrics)
    old = [json.dumps({"step": s}) for s in (1, 2)]
    history.restore({"metrics": old}, 2, pytest.fail)
    _append(metrics, json.dumps({"step": 3}) + "\n")
    (segment,) = _save(history, store, 3, 2)[SEGMENTS]
    assert store.get_bytes(segment["key"]).decode().splitlines() == [*old, '{"step": 3}']


def test_a_long_runs_checkpoints_stay_the_same_size(tmp_path, monkeypatch, capsys):
    """A real run, a checkpoint every 2 steps: the last checkpoint's extra.json is as
    small as the first's (the whole history used to grow in each), and a run resumed
    from it in a new folder has every line of the file."""
    from rlft.trainer.cli.main import main

    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=16)
    spec["checkpoint"] = {"intervalSteps": 2, "keepLast": 8}
    write_parity_job(tmp_path, spec)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml", "--out", "out"]) == 0
    folders = sorted((tmp_path / "out" / "checkpoints").glob("step-*"))
    sizes = [len((folder / "extra.json").read_bytes()) for folder in folders]
    grown = (tmp_path / "out" / "metrics.jsonl").stat().st_size
    assert grown > 8000 and sizes[-1] - sizes[0] < 2000, (sizes, grown)
    segments = sorted((tmp_path / "out" / "checkpoints" / "metrics").iterdir())
    assert sum(s.stat().st_size for s in segments) == grown
    # Outside the step folders and their manifests: `rlft checkpoints verify` checks them.
    checkpoints = str(tmp_path / "out" / "checkpoints")
    assert main(["checkpoints", "verify", checkpoints]) == 0
    segments[0].write_text('{"step": 1}\n')
    assert main(["checkpoints", "verify", checkpoints]) == 1
    assert f"history metrics/{segments[0].name}: SHA-256 differs" in capsys.readouterr().out
    sys.modules.pop("parity_reward", None)
