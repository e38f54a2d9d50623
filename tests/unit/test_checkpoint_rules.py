"""The pure rules of checkpoints: manifests, resume order, retention, cadence, retries,
URI parsing, redaction; and the file:// backend's atomic writes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlft.trainer.checkpoint.errors import BadUriError, ManifestError, StorageError, redact
from rlft.trainer.checkpoint.manifest import (
    FRESH_START,
    FileEntry,
    Manifest,
    config_hash,
    off_timeline,
    parse_step_dir,
    parse_which,
    problems_with,
    resume_order,
    retention_plan,
    split_location,
    step_dir,
)
from rlft.trainer.checkpoint.schedule import SavePolicy
from rlft.trainer.storage.backends import FileStorage, S3Options, open_storage, parse_file_uri
from rlft.trainer.storage.retry import backoff_delays, with_retries
from rlft.trainer.storage.s3 import parse_s3_uri, read_credentials_dir

# ------------------------------------------------------------------------ manifest


def _manifest(step: int = 120, healthy: bool = True) -> Manifest:
    return Manifest(
        step=step,
        policy_version=step + 1,
        world_size=2,
        config_hash=config_hash({"a": 1}),
        healthy=healthy,
        files=(FileEntry("__0_0.distcp", 10, "ab" * 32), FileEntry("extra.json", 3, "cd" * 32)),
    )


def test_manifest_round_trips_and_names_its_folder() -> None:
    manifest = _manifest()
    again = Manifest.from_json(manifest.to_json(), "x")
    assert again == manifest
    assert manifest.folder == "step-000120"
    assert manifest.total_bytes == 13
    assert json.loads(manifest.to_json())["worldSize"] == 2


def test_the_parent_round_trips_and_an_older_manifest_has_none() -> None:
    manifest = dataclasses.replace(_manifest(), parent=110)
    assert json.loads(manifest.to_json())["parent"] == 110
    assert Manifest.from_json(manifest.to_json(), "x") == manifest
    assert "parent" not in json.loads(_manifest().to_json())
    assert Manifest.from_json(_manifest().to_json(), "x").parent is None


def test_piece_checksums_round_trip_and_must_cover_the_file() -> None:
    """Shard files carry a SHA-256 per `blockBytes` piece (what a resume checks as it
    reads); a manifest without them reads as before (whole files)."""
    shard = FileEntry("__0_0.distcp", 10, "ab" * 32, ("01" * 32, "02" * 32, "03" * 32))
    manifest = dataclasses.replace(_manifest(), files=(shard,), block_bytes=4)
    doc = json.loads(manifest.to_json())
    assert doc["blockBytes"] == 4 and len(doc["files"][0]["blocks"]) == 3
    assert Manifest.from_json(manifest.to_json(), "x") == manifest
    assert "blocks" not in json.loads(_manifest().to_json())["files"][0]
    doc["files"][0]["blocks"] = doc["files"][0]["blocks"][:2]  # 10 bytes are 3 pieces of 4
    with pytest.raises(ManifestError, match="2 block checksums for 10 bytes"):
        Manifest.from_json(json.dumps(doc), "x")


@pytest.mark.parametrize(
    "text", ["{", "[]", '{"formatVersion": 1}', '{"formatVersion": 1, "step": "x", "files": []}']
)
def test_a_malformed_manifest_is_an_error_naming_it(text: str) -> None:
    with pytest.raises(ManifestError, match=r"s3://b/step-000001/manifest\.json"):
        Manifest.from_json(text, "s3://b/step-000001/manifest.json")


def test_a_manifest_from_a_newer_format_asks_for_an_upgrade() -> None:
    doc = json.loads(_manifest().to_json())
    doc["formatVersion"] = 99
    with pytest.raises(ManifestError, match="upgrade rlft"):
        Manifest.from_json(json.dumps(doc), "m")


def test_problems_name_missing_resized_and_corrupted_files() -> None:
    manifest = _manifest()
    assert problems_with(manifest, {"__0_0.distcp": (10, "ab" * 32), "extra.json": (3, None)}) == []
    problems = problems_with(manifest, {"__0_0.distcp": (10, "00" * 32)})
    assert problems == ["__0_0.distcp: checksum mismatch (corrupted)", "extra.json: missing"]
    assert "9 bytes" in problems_with(manifest, {"__0_0.distcp": (9, None)})[0]


@given(st.integers(0, 10**9))
def test_step_folders_round_trip(step: int) -> None:
    assert parse_step_dir(step_dir(step)) == step


@given(st.integers(0, 10**6 - 2))
def test_step_folders_sort_by_step_below_a_million(step: int) -> None:
    """Six digits: past step 999999 the names no longer sort (the catalog orders by the
    parsed step, never by name)."""
    assert step_dir(step) < step_dir(step + 1)


@pytest.mark.parametrize("name", ["step-12", "step-00001x", "latest", "step--00001", ".rlft"])
def test_other_names_are_not_checkpoints(name: str) -> None:
    assert parse_step_dir(name) is None


def test_config_hash_ignores_key_order() -> None:
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


# -------------------------------------------------------------------------- resume


def test_parse_which() -> None:
    assert parse_which("auto") == "auto"
    assert parse_which("latest") == "auto"
    assert parse_which("latest-healthy") == "latest-healthy"
    assert parse_which("120") == 120
    with pytest.raises(ValueError, match="--resume must be"):
        parse_which("newest")


def test_resume_follows_the_pointer_and_falls_back_to_older_ones() -> None:
    committed = {10: True, 20: False, 30: True, 40: False}
    assert resume_order(committed, 40, "auto") == [40, 30, 20, 10]
    assert resume_order(committed, 40, "latest-healthy") == [30, 10]
    assert resume_order(committed, 40, 20) == [20]  # no fallback from a named step
    assert resume_order(committed, 40, 25) == []  # an explicit step must exist
    # After a rollback to 30 (pointer there), the abandoned 40 is never taken.
    assert resume_order(committed, 30, "auto") == [30, 20, 10]
    # No pointer (crash between the first manifest and the pointer): newest manifest.
    assert resume_order(committed, None, "auto") == [40, 30, 20, 10]
    assert resume_order({}, None, "auto") == []


def test_a_dangling_pointer_still_bounds_the_timeline() -> None:
    """A pointer naming a folder without a readable manifest (its save was withdrawn,
    or the manifest is damaged) still marks the timeline: the newest commit not above
    it is taken, never the abandoned ones above it."""
    committed = {10: True, 20: False, 30: True, 40: True}
    assert resume_order(committed, 35, "auto") == [30, 20, 10]
    assert resume_order(committed, 25, "latest-healthy") == [10]
    assert resume_order(committed, 5, "auto") == []


@given(
    st.dictionaries(st.integers(0, 60), st.booleans(), max_size=12),
    st.one_of(st.none(), st.integers(0, 60)),
    st.sampled_from(["auto", "latest-healthy"]),
)
def test_resume_order_is_newest_first_and_never_above_the_pointer(
    committed: dict[int, bool], latest: int | None, which: str
) -> None:
    order = resume_order(committed, latest, which)
    assert order == sorted(order, reverse=True)
    assert all(step in committed for step in order)
    if latest is not None and latest in committed:
        assert all(step <= latest for step in order)
        if which == "auto":
            assert order[0] == latest
    if which == "latest-healthy":
        assert all(committed[step] for step in order)


def test_steps_between_the_links_of_the_chain_are_another_timeline() -> None:
    """A `--resume 50` that committed 60 (saves every 10) over a run that had saved 55
    (an emergency save) and 60: the old 55 is not the new 60's past, and a fallback
    from a damaged 60 must take 50, not the timeline the user left."""
    committed = {40: True, 50: True, 55: True, 60: True}
    parents = {40: 30, 50: 40, 55: 50, 60: 50}
    assert off_timeline(parents, 60) == {55}
    assert resume_order(committed, 60, "auto", parents) == [60, 50, 40]
    assert resume_order(committed, 60, "latest-healthy", parents) == [60, 50, 40]
    assert resume_order(committed, 60, 55, parents) == [55]  # by name, still
    # A rollback from 58 to 50 that committed 51: 55 is above nothing of its chain.
    rolled = {50: 40, 55: 50, 51: 50}
    assert off_timeline(rolled, 51) == set()
    assert resume_order(dict.fromkeys(rolled, True), 55, "auto", rolled) == [55, 50]


def test_where_the_chain_ends_every_older_step_is_the_timelines() -> None:
    """A parent deleted by retention still bounds what is known: between it and its
    child nothing is the timeline's; below it, lineage is unknown and kept."""
    parents = {20: 10, 25: 20, 30: 20, 35: 30, 40: 30}
    del parents[30]  # retention deleted it: 40 names it
    assert off_timeline(parents, 40) == {35}
    # No parent (a fresh start, or an older rlft): nothing is known below it.
    assert off_timeline({20: 10, 25: 20, 30: None}, 30) == set()
    assert off_timeline({20: None, 25: None, 30: 20}, 30) == {25}
    assert off_timeline({}, 30) == set()
    # A run that started from none (--overwrite): nothing older is its past.
    assert off_timeline({10: None, 20: 10, 30: FRESH_START, 40: 30}, 40) == {10, 20}
    assert off_timeline({30: 20}, None) == set()


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4)), max_size=30), st.integers(1, 3))
def test_resume_and_retention_keep_to_the_pointers_past_across_resumes(
    moves: list[tuple[bool, int]], keep: int
) -> None:
    """Runs that commit, and resume (or roll back to) older checkpoints and commit over
    them, with retention after each commit: whatever is left, a resume by the pointer
    only ever takes the pointer's own past, and the newest of it are still there."""
    true_parent: dict[int, int | None] = {}  # every commit ever, by its parent
    parents: dict[int, int | None] = {}  # what the location holds
    latest: int | None = None
    current: int | None = None  # the step the run's weights descend from
    for descend, n in moves:
        if descend and parents:
            current = sorted(parents)[-min(n, len(parents))]
            continue
        step = (current or 0) + n
        true_parent[step] = parents[step] = current
        latest = current = step
        for gone in retention_plan(dict.fromkeys(parents, True), set(), latest, keep, parents):
            del parents[gone]
        past = set()
        walk: int | None = latest
        while walk is not None:
            past.add(walk)
            walk = true_parent[walk]
        order = resume_order(dict.fromkeys(parents, True), latest, "auto", parents)
        assert set(order) <= past
        assert order[: min(keep, len(order))] == sorted(past & set(parents), reverse=True)[:keep]


# ----------------------------------------------------------------------- retention


def test_retention_keeps_last_n_and_healthy_and_drops_leftovers() -> None:
    committed = {10: True, 20: False, 30: False, 40: False, 50: False, 60: False}
    assert retention_plan(committed, {5, 55, 70}, 60, keep_last=2) == {20, 30, 40, 5, 55}
    # an abandoned timeline above the pointer goes, even when healthy
    assert retention_plan({10: True, 20: True, 30: True}, set(), 10, keep_last=3) == {20, 30}
    assert retention_plan(committed, {1}, None, keep_last=1) == set()
    with pytest.raises(ValueError, match="keep_last"):
        retention_plan(committed, set(), 60, keep_last=0)


def test_retention_deletes_what_is_between_the_links_of_the_chain() -> None:
    parents = {40: 30, 50: 40, 55: 50, 60: 50}
    assert retention_plan(dict.fromkeys(parents, True), set(), 60, 2, parents) == {40, 55}
    assert retention_plan(dict.fromkeys(parents, True), set(), 60, 3, parents) == {55}
    # without parents (an older rlft's manifests) it is kept as the timeline's
    assert retention_plan(dict.fromkeys(parents, True), set(), 60, 3) == {40}


def test_retention_leaves_the_folder_the_pointer_names_without_a_manifest() -> None:
    """Only leftovers below `latest` are interrupted saves: the folder the pointer
    names (its manifest damaged or withdrawn) is not deleted as one."""
    assert retention_plan({10: True}, {20, 15}, 20, keep_last=1) == {15}


def test_retention_keeps_the_newest_healthy_ones_not_every_one() -> None:
    """A long healthy run: every checkpoint tagged healthy was kept, and its storage
    grew without bound."""
    healthy = {step: True for step in range(10, 110, 10)}
    assert retention_plan(healthy, set(), 100, keep_last=2) == set(range(10, 90, 10))
    # the newest keep_last healthy ones stay besides the newest keep_last: the rollback
    # targets (and their fallbacks) of a run whose newest checkpoints are unhealthy
    mixed = {10: True, 20: True, 30: True, 40: False, 50: False, 60: False}
    assert retention_plan(mixed, set(), 60, keep_last=2) == {10, 40}
    assert retention_plan(mixed, set(), 60, keep_last=1) == {10, 20, 40, 50}


@given(
    st.dictionaries(st.integers(0, 50), st.booleans(), min_size=1, max_size=15),
    st.sets(st.integers(0, 60), max_size=6),
    st.integers(1, 5),
    st.data(),
)
def test_retention_keeps_latest_the_newest_and_the_newest_healthy_and_no_more(
    committed: dict[int, bool], uncommitted: set[int], keep: int, data
) -> None:
    latest = data.draw(st.sampled_from(sorted(committed)))
    # `uncommitted` may name committed steps too: those are decided as committed ones
    doomed = retention_plan(committed, uncommitted, latest, keep)
    assert latest not in doomed
    timeline = sorted((s for s in committed if s <= latest), reverse=True)
    healthy = [s for s in timeline if committed[s]]
    assert not doomed & set(timeline[:keep])
    assert not doomed & set(healthy[:keep])
    kept = [s for s in committed if s not in doomed]
    assert len(kept) <= 2 * keep + 1  # bounded, however long the run
    assert set(kept) == set(timeline[:keep]) | set(healthy[:keep]) | {latest}
    assert not doomed & {s for s in uncommitted if s > latest and s not in committed}


# ------------------------------------------------------------------------- cadence


def test_policy_saves_on_multiples_of_the_interval_and_after_the_minutes() -> None:
    now = [0.0]
    policy = SavePolicy(interval_steps=5, interval_minutes=1.0, clock=lambda: now[0])
    due = []
    for step in range(1, 12):
        now[0] += 1
        if policy.due(step):
            due.append(step)
            policy.saved()
    assert due == [5, 10]
    now[0] += 61
    assert policy.due(12)
    # a due save that could not start stays pending until it does
    assert policy.due(13)
    policy.saved()
    assert not policy.due(14)
    with pytest.raises(ValueError):
        SavePolicy(0, 1.0)
    with pytest.raises(ValueError):
        SavePolicy(5, 0.0)


def test_the_minute_interval_counts_from_the_start_and_includes_its_boundary() -> None:
    """The clock is not assumed to start at 0 (monotonic time); a save is due once
    exactly intervalMinutes have passed, not a step later."""
    now = [5000.0]
    policy = SavePolicy(interval_steps=1000, interval_minutes=2.0, clock=lambda: now[0])
    now[0] += 119.0
    assert not policy.due(1)
    now[0] += 1.0  # exactly 120 s since the start
    assert policy.due(2)
    policy.saved()
    now[0] += 119.5
    assert not policy.due(3)
    now[0] += 0.5
    assert policy.due(4)


def test_a_step_save_that_could_not_start_stays_pending() -> None:
    """A save due at a multiple of intervalSteps while the previous one is in flight
    happens at the next step, not at the next multiple."""
    now = [0.0]
    policy = SavePolicy(interval_steps=5, interval_minutes=60.0, clock=lambda: now[0])
    assert [step for step in range(1, 5) if policy.due(step)] == []
    assert policy.due(5)
    assert policy.due(6) and policy.due(7)  # not saved yet: still due
    policy.saved()
    assert not policy.due(8)


# ------------------------------------------------------------------------- retries


def test_backoff_grows_to_the_cap() -> None:
    delays = backoff_delays(0.5, 4.0)
    assert [next(delays) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    jittered = backoff_delays(1.0, 8.0, jitter=0.5)
    assert all(0.5 * 2**i <= next(jittered) <= 2**i for i in range(3))


def test_retries_transient_errors_until_the_deadline() -> None:
    now = [0.0]
    calls = []

    def flaky():
        calls.append(now[0])
        if len(calls) < 4:
            raise StorageError("server restarting", transient=True)
        return "ok"

    seen = []
    result = with_retries(
        flaky,
        deadline_s=100,
        clock=lambda: now[0],
        sleep=lambda s: now.__setitem__(0, now[0] + s),
        on_retry=lambda attempt, error, delay: seen.append(attempt),
    )
    assert result == "ok" and seen == [1, 2, 3]

    def always():
        raise StorageError("down", transient=True)

    now[0] = 0.0
    with pytest.raises(StorageError, match="down"):
        with_retries(
            always,
            deadline_s=10,
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + s),
        )
    assert now[0] <= 10


def test_a_deadline_brought_closer_while_retrying_stops_the_retries() -> None:
    """A stop signal bounds a save in flight to the grace period left (`until`): no
    attempt starts past it, also when it came during a wait."""
    now, until, calls = [0.0], [900.0], []

    def always():
        calls.append(now[0])
        raise StorageError("down", transient=True)

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if len(calls) == 3:
            until[0] = now[0]  # the stop, during the third wait

    with pytest.raises(StorageError, match="down"):
        with_retries(
            always, deadline_s=900, clock=lambda: now[0], sleep=sleep, until=lambda: until[0]
        )
    assert len(calls) == 3
    calls.clear()
    until[0] = now[0] + 0.1  # closer than the next wait: no wait at all
    with pytest.raises(StorageError):
        with_retries(always, deadline_s=900, clock=lambda: now[0], until=lambda: until[0])
    assert len(calls) == 1


def test_permanent_errors_are_not_retried() -> None:
    calls = []

    def broken():
        calls.append(1)
        raise StorageError("bucket missing")

    with pytest.raises(StorageError):
        with_retries(broken, deadline_s=100, sleep=lambda s: None)
    assert len(calls) == 1


# ---------------------------------------------------------------------------- URIs


def test_uris() -> None:
    assert parse_s3_uri("s3://my-bucket/runs/a/") == ("my-bucket", "runs/a")
    assert parse_s3_uri("s3://my-bucket") == ("my-bucket", "")
    assert parse_file_uri("file:///data/x") == Path("/data/x")
    assert parse_file_uri("relative/x") == Path("relative/x").resolve()
    assert split_location("s3://b/run/step-000120") == ("s3://b/run", 120)
    assert split_location("s3://b/run/") == ("s3://b/run/", "auto")
    assert split_location("/data/run/step-000007/") == ("/data/run", 7)


@pytest.mark.parametrize(
    ("uri", "words"),
    [
        ("s3://", "s3://bucket/prefix"),
        ("s3://Bad_Bucket!/x", "not a valid bucket name"),
        ("file://relative/path", "absolute path"),
        ("gs://bucket/x", "unsupported scheme"),
        ("", "empty"),
    ],
)
def test_bad_uris_say_what_a_good_one_looks_like(uri: str, words: str) -> None:
    with pytest.raises(BadUriError, match=words):
        open_storage(uri)


@pytest.mark.parametrize(
    ("uri", "options"),
    [
        ("s3://AKIDEXAMPLE:s3cr3t-value@store.local/ckpt", S3Options()),
        ("s3://bucket/ckpt", S3Options(endpoint_url="http://AKIDEXAMPLE:s3cr3t-value@store:8333")),
    ],
)
def test_a_location_given_with_credentials_is_refused_without_repeating_them(uri, options):
    """`rlft checkpoints list/verify/export` take locations from the command line."""
    with pytest.raises(BadUriError, match="must not hold credentials") as error:
        open_storage(uri, options)
    assert "s3cr3t-value" not in str(error.value) and "AKIDEXAMPLE" not in str(error.value)


def test_credentials_folder(tmp_path: Path) -> None:
    (tmp_path / "AWS_ACCESS_KEY_ID").write_text("AKIDEXAMPLE\n")
    (tmp_path / "aws_secret_access_key").write_text("s3cr3t-value\n")
    found = read_credentials_dir(str(tmp_path))
    assert found == {"aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "s3cr3t-value"}
    (tmp_path / "aws_secret_access_key").unlink()
    with pytest.raises(StorageError, match="no file named AWS_SECRET_ACCESS_KEY") as error:
        read_credentials_dir(str(tmp_path))
    assert "AKIDEXAMPLE" not in str(error.value)
    with pytest.raises(StorageError, match="does not exist"):
        read_credentials_dir(str(tmp_path / "nope"))


def test_redact() -> None:
    assert redact("key s3cr3t-value rejected", ["s3cr3t-value", None, ""]) == "key *** rejected"


# ------------------------------------------------------------------------ file://


def test_file_storage_operations(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "root")
    store.put_bytes("step-000001/a.bin", b"hello")
    source = tmp_path / "src.bin"
    source.write_bytes(b"x" * 1000)
    store.put_file("step-000001/sub/b.bin", source)
    assert source.exists()
    store.put_file("step-000002/c.bin", source, move=True)
    assert not source.exists()
    assert [(i.key, i.size) for i in store.list()] == [
        ("step-000001/a.bin", 5),
        ("step-000001/sub/b.bin", 1000),
        ("step-000002/c.bin", 1000),
    ]
    assert store.get_bytes("step-000001/a.bin") == b"hello"
    assert store.exists("step-000002/c.bin") and not store.exists("nope")
    assert store.delete_prefix("step-000001/") == 2
    assert not (tmp_path / "root" / "step-000001").exists()
    with pytest.raises(StorageError, match="does not exist"):
        store.get_bytes("step-000001/a.bin")
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"")


def test_a_folder_that_cannot_be_read_fails_the_listing(tmp_path: Path, monkeypatch) -> None:
    """os.walk skipped an unreadable folder: a passing NFS fault on a step folder made a
    resume go back to an older step, on the root a fresh start (whose retention then
    deleted every checkpoint). The fault (EIO reading step 20's folder) is injected where
    the kernel reports it, and the listing fails, retryably, naming the folder."""
    store = FileStorage(tmp_path)
    store.put_bytes("step-000010/manifest.json", b"{}")
    store.put_bytes("step-000020/manifest.json", b"{}")
    real_scandir = os.scandir

    def scandir(path="."):
        if str(path).endswith("step-000020"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(StorageError, match=r"listing .*step-000020 .* failed") as failed:
        store.list()
    assert failed.value.transient
    monkeypatch.setattr(os, "scandir", real_scandir)
    assert [info.key for info in store.list()] == [
        "step-000010/manifest.json",
        "step-000020/manifest.json",
    ]


@pytest.mark.parametrize(
    "uri",
    [
        "https://AKIAUSER:SECRETXYZ@minio.example:9000/bucket/run",
        "file://AKIAUSER:SECRETXYZ@host/x",
        "s3://bucket/x?token=SECRETXYZ",
        "s3://bucket/x#SECRETXYZ",
    ],
)
def test_a_location_refused_is_named_without_its_secret(uri: str) -> None:
    with pytest.raises(BadUriError) as refused:
        open_storage(uri)
    message = str(refused.value)
    assert "SECRETXYZ" not in message and "AKIAUSER" not in message, message
    assert "…" in message  # said that something was left out


def test_another_jobs_checkpoints_are_left_out_but_those_of_no_known_job_stay() -> None:
    """A location shared by mistake: another job's commits are never resumed; those
    written without a job uid (a local run, an rlft from before uids) stay a choice."""
    from rlft.trainer.checkpoint.catalog import Scan

    mine, other, unknown = (
        dataclasses.replace(_manifest(step), job_uid=uid)
        for step, uid in ((10, "job-a"), (20, "job-b"), (30, None))
    )
    scan = Scan(manifests={10: mine, 20: other, 30: unknown}, latest=30)
    kept = scan.without_other_jobs("job-a")
    assert sorted(kept.manifests) == [10, 30]
    assert kept.latest == 30 and sorted(scan.manifests) == [10, 20, 30]  # a new scan
    assert sorted(scan.own("job-a")) == [10]


def test_verify_names_a_location_it_refuses_without_its_secret(capsys) -> None:
    from rlft.trainer.cli.main import main

    uri = "s3://AKIAUSER:SECRETXYZ@bucket/run/step-000100"
    assert main(["checkpoints", "verify", uri, "--step", "5"]) == 2
    said = capsys.readouterr().err
    assert "names step 100, --step 5: give one" in said and "SECRETXYZ" not in said


def test_a_download_whose_socket_kept_timing_out_is_transient(monkeypatch) -> None:
    """s3transfer retries a download's reads on the socket's own errors and gives up with
    the last one (RetriesExceededError): a network fault to retry, not a damaged file that
    a resume skips for an older checkpoint."""

    from boto3.exceptions import RetriesExceededError

    from rlft.trainer.storage.s3 import S3Storage

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    store = S3Storage("s3://bucket/run", S3Options(endpoint_url="http://127.0.0.1:9"))
    for cause in (TimeoutError("timed out"), ConnectionResetError(104, "reset")):
        error = store._translate(RetriesExceededError(cause), "downloading step-000001/x")
        assert error.transient and "cannot reach" in str(error), error
