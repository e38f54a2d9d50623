"""metrics.jsonl's history kept with the checkpoints as segments: each save uploads the
lines since the last committed checkpoint, not the whole file again (whose copies grew
each checkpoint, and the trainer's memory, with the length of the run)."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import pytest
from tiny_jobs import arithmetic_rl_spec, write_parity_job

from rlft.trainer.checkpoint.history import (
    FANOUT,
    MAX_DELETES,
    SEGMENTS,
    MetricsHistory,
    merge_plan,
)
from rlft.trainer.storage.backends import FileStorage


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


def test_a_segment_the_store_refuses_for_a_moment_is_read_again(
    tmp_path, s3_env, bucket, store_proxy
):
    """A resume retries a segment as it retries the checkpoint: a 503 cost its lines. A
    real SeaweedFS bucket behind a proxy answering 503 to its first two reads
    (botocore's own retries off, so each reaches the history's)."""
    from checkpoint_fixtures import s3_options

    from rlft.trainer.storage.backends import open_storage

    store = open_storage(f"s3://{bucket}/run", s3_options(s3_env))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(_lines(range(1, 6)))
    extra = _save(MetricsHistory(store, metrics), store, 5, None)
    options = s3_options(s3_env, endpoint_url=store_proxy.url, max_attempts=0)
    behind = open_storage(f"s3://{bucket}/run", options)
    store_proxy.refuse("/", reads=True, times=2)
    elsewhere = tmp_path / "elsewhere.jsonl"
    MetricsHistory(behind, elsewhere, retry_s=60).restore(extra, 5, pytest.fail)
    assert len(store_proxy.held_paths) == 2
    assert elsewhere.read_text() == _lines(range(1, 6))


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


def _train(tmp_path: Path, monkeypatch, steps: int, checkpoint: dict) -> None:
    """`rlft train` of a GRPO job of `steps` with `spec.checkpoint` = `checkpoint`."""
    from rlft.trainer.cli.main import main

    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=steps)
    spec["checkpoint"] = checkpoint
    write_parity_job(tmp_path, spec)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml", "--out", "out"]) == 0


def test_a_long_runs_checkpoints_stay_the_same_size(tmp_path, monkeypatch, capsys):
    """A real run, a checkpoint every 2 steps: the last checkpoint's extra.json is as
    small as the first's (the whole history used to grow in each), and a run resumed
    from it in a new folder has every line of the file."""
    from rlft.trainer.cli.main import main

    _train(tmp_path, monkeypatch, steps=16, checkpoint={"intervalSteps": 2, "keepLast": 8})
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


def _replay_plans(saves_made: int, sizes: list[int]) -> tuple[list[tuple[int, int]], int]:
    """merge_plan applied after every save, as for_save does: the last list's
    (saves, bytes) per segment and the bytes uploaded in all."""
    segments: list[tuple[int, int]] = []
    uploaded = 0
    for size in sizes[:saves_made]:
        segments.append((1, size))
        plan = merge_plan([s for s, _ in segments], [b for _, b in segments])
        merged = []
        for start, end in plan:
            run = segments[start:end]
            if end - start > 1 or start == len(segments) - 1:
                uploaded += sum(b for _, b in run)
            merged.append((sum(s for s, _ in run), sum(b for _, b in run)))
        segments = merged
    return segments, uploaded


def test_a_long_runs_list_of_segments_stays_short_and_each_line_is_uploaded_a_few_times():
    """5,000 saves: the list holds at most FANOUT-1 segments per power of FANOUT (it held
    one per save, read one by one at every resume), and a line is uploaded once per
    level it climbs."""
    rng = random.Random(0)
    sizes = [rng.randint(200, 4000) for _ in range(5000)]
    for saves in (1, 15, 16, 17, 255, 256, 4095, 4096, 5000):
        segments, uploaded = _replay_plans(saves, sizes)
        levels = len(f"{saves:x}")  # base-16 digits
        assert sum(s for s, _ in segments) == saves
        assert sum(b for _, b in segments) == sum(sizes[:saves])
        # As a base-FANOUT counter: one segment per unit of each digit of `saves`.
        assert len(segments) == sum(int(d, 16) for d in f"{saves:x}"), (saves, segments)
        assert uploaded <= (levels + 1) * sum(sizes[:saves])
    assert FANOUT == 16


def test_no_merge_makes_a_segment_larger_than_the_limit():
    plan = merge_plan([1] * 16, [10] * 16, max_bytes=159)
    assert plan == [(i, i + 1) for i in range(16)]
    assert merge_plan([1] * 16, [10] * 16, max_bytes=160) == [(0, 16)]


def test_a_long_list_from_before_compaction_is_merged_over_several_saves():
    """1,000 one-save segments of 100 KB (a list from before compaction): one save used to
    read and upload nearly the whole history at once; now each uploads at most the limit,
    and the list is compacted over the saves that follow."""
    segments = [(1, 100_000)] * 1000
    limit = 2_000_000
    for _ in range(200):
        segments.append((1, 100))  # each save's new lines
        plan = merge_plan([s for s, _ in segments], [b for _, b in segments], max_bytes=limit)
        runs = [segments[start:end] for start, end in plan]
        assert sum(sum(b for _, b in run) for run in runs if len(run) > 1) <= limit
        segments = [(sum(s for s, _ in run), sum(b for _, b in run)) for run in runs]
    # Merged 16 at a time, one window a save (the limit allows one); fewer than 16 of the
    # old segments are left alone, and no merge made a segment over the limit.
    assert sum(s for s, _ in segments) == 1200 and len(segments) < 100
    assert sum(1 for s, b in segments if (s, b) == (1, 100_000)) < 16
    assert max(b for _, b in segments) <= limit


def _saved_folder(store: FileStorage, step: int, extra: dict) -> None:
    store.put_bytes(f"step-{step:06d}/extra.json", json.dumps(extra).encode())


def test_merged_segments_restore_the_same_file_and_the_unlisted_ones_are_deleted(tmp_path, store):
    """300 saves through for_save with a real store: the list stays short, a restore from
    any retained checkpoint gives that checkpoint's file byte for byte, and after
    retention only the segments a retained checkpoint (or the saver) lists remain."""
    metrics = tmp_path / "metrics.jsonl"
    history = MetricsHistory(store, metrics)
    files: dict[int, str] = {}
    committed = None
    for step in range(1, 301):
        _append(metrics, _lines(range(step * 10, step * 10 + (step % 7) + 1)))
        extra = _save(history, store, step, committed)
        _saved_folder(store, step, extra)
        files[step] = metrics.read_text()
        committed = step
        for old in range(1, step - 2):  # retention: the newest 3 folders stay
            store.delete_prefix(f"step-{old:06d}/")
        history.collect(step)
    assert len(extra[SEGMENTS]) == sum(int(d, 16) for d in f"{300:x}")  # 1 + 2 + 12
    listed = {
        segment["key"]
        for step in (298, 299, 300)
        for segment in json.loads(store.get_bytes(f"step-{step:06d}/extra.json"))[SEGMENTS]
    }
    assert {i.key for i in store.list("metrics/")} == listed
    for step in (298, 299, 300):
        elsewhere = tmp_path / f"restored-{step}.jsonl"
        extra = json.loads(store.get_bytes(f"step-{step:06d}/extra.json"))
        MetricsHistory(store, elsewhere).restore(extra, step, pytest.fail)
        assert elsewhere.read_text() == files[step]


def test_the_collector_spares_what_a_save_may_still_list(tmp_path, store):
    """A save is made while its predecessor uploads (for_save does not wait): it lists
    the last committed checkpoint's segments, whose folder retention may delete when the
    one in flight commits. Those, the pending save's, later saves' and objects that are
    not segments stay."""
    metrics = tmp_path / "metrics.jsonl"
    history = MetricsHistory(store, metrics)
    _append(metrics, _lines(range(1, 3)))
    first = _save(history, store, 2, None)  # committed below; its folder will go
    _append(metrics, _lines(range(3, 5)))
    pending = _save(history, store, 4, 2)  # in flight
    store.put_bytes("metrics/step-000009-0000abcd.jsonl", b"a later save's\n")
    store.put_bytes("metrics/notes.txt", b"not a segment\n")
    orphan = "metrics/step-000001-deadbeef.jsonl"  # a save that never committed
    store.put_bytes(orphan, b"lost\n")
    assert history.collect(4) == [orphan]
    kept = {i.key for i in store.list("metrics/")}
    assert {s["key"] for s in first[SEGMENTS] + pending[SEGMENTS]} <= kept
    assert {"metrics/step-000009-0000abcd.jsonl", "metrics/notes.txt"} <= kept


def test_the_collector_deletes_a_bounded_number_at_a_time(tmp_path, store):
    """It runs in the commit's path: a run from before compaction leaves one segment per
    save to delete once its last checkpoints go, spread over the commits that follow."""
    orphans = [f"metrics/step-{i:06d}-{i:08x}.jsonl" for i in range(MAX_DELETES + 6)]
    for key in orphans:
        store.put_bytes(key, b"old\n")
    history = MetricsHistory(store, tmp_path / "metrics.jsonl")
    assert len(history.collect(10**6)) == MAX_DELETES
    assert history.collect(10**6) == orphans[MAX_DELETES:]
    assert not store.list("metrics/")


def test_a_list_from_before_compaction_is_merged_at_the_next_save(tmp_path, store):
    """A run's 40 one-save segments (an rlft before compaction wrote no `saves`) become
    the compacted list at the next save, and its file is restored the same."""
    metrics = tmp_path / "metrics.jsonl"
    segments = []
    for index in range(40):
        text = _lines(range(index * 2, index * 2 + 2)).encode()
        key = f"metrics/step-{index:06d}-{index:08x}.jsonl"
        store.put_bytes(key, text)
        segments.append({"key": key, "sha256": hashlib.sha256(text).hexdigest()})
    history = MetricsHistory(store, metrics)
    history.restore({SEGMENTS: segments}, 80, pytest.fail)
    _append(metrics, _lines(range(80, 82)))
    extra = _save(history, store, 82, 80)
    # Newest first: the 41 segments' last 32 in two, the oldest nine as they were.
    assert [s.get("saves", 1) for s in extra[SEGMENTS]] == [1] * 9 + [16, 16]
    assert extra[SEGMENTS][:9] == segments[:9]
    elsewhere = tmp_path / "elsewhere.jsonl"
    MetricsHistory(store, elsewhere).restore(extra, 82, pytest.fail)
    assert elsewhere.read_text() == metrics.read_text() == _lines(range(0, 82))


def test_a_run_that_prunes_its_checkpoints_keeps_only_the_segments_they_list(tmp_path, monkeypatch):
    """A real run, a checkpoint every step and the newest two kept, segments merged by
    fours: its 20 saves' lists are compacted, retention's "pruned" event has the
    trainer delete every segment no retained checkpoint lists, and the last checkpoint
    still restores the whole file."""
    from rlft.trainer.checkpoint import history

    monkeypatch.setattr(history, "FANOUT", 4)
    _train(tmp_path, monkeypatch, steps=20, checkpoint={"intervalSteps": 1, "keepLast": 2})
    sys.modules.pop("parity_reward", None)
    store = FileStorage(tmp_path / "out" / "checkpoints")
    extras = {
        info.key: json.loads(store.get_bytes(info.key))
        for info in store.list("step-")
        if info.key.endswith("/extra.json")
    }
    assert len(extras) == 2, sorted(extras)
    listed = {s["key"] for extra in extras.values() for s in extra[SEGMENTS]}
    assert {i.key for i in store.list("metrics/")} == listed
    # A save made while its predecessor uploads covers that one's lines again (saves
    # are not waited for), so fewer than 20 saves are counted; 3 digits in base 4.
    saves = [s.get("saves", 1) for s in extras[max(extras)][SEGMENTS]]
    assert max(saves) >= 4 and len(saves) <= 9, saves
    elsewhere = tmp_path / "elsewhere.jsonl"
    MetricsHistory(store, elsewhere).restore(extras[max(extras)], 20, pytest.fail)
    assert elsewhere.read_text() == (tmp_path / "out" / "metrics.jsonl").read_text()
