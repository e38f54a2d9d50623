"""Both storage backends against real storage: a SeaweedFS S3 server on loopback and a
local folder; the errors a user meets (missing bucket, wrong credentials, full disk)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from checkpoint_fixtures import s3_options, tmpfs
from seaweedfs import SECRET_KEY

from rlft.trainer.checkpoint.errors import (
    BucketMissingError,
    CredentialsError,
    ObjectMissingError,
    StorageError,
    StorageFullError,
)
from rlft.trainer.storage.backends import TEMP_MARK, FileStorage, open_storage, sha256_file


def test_put_get_list_exists_delete(store, tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(12 << 20))  # > one 5 MiB part: a parallel multipart upload
    store.put_file("step-000001/__0_0.distcp", big)
    store.put_bytes("step-000001/manifest.json", b"{}")
    store.put_bytes("step-000002/extra.json", b"[1]")
    store.put_bytes("latest", b"step-000001\n")
    listed = {info.key: info.size for info in store.list()}
    assert listed == {
        "latest": 12,
        "step-000001/__0_0.distcp": 12 << 20,
        "step-000001/manifest.json": 2,
        "step-000002/extra.json": 3,
    }
    assert [i.key for i in store.list("step-000002/")] == ["step-000002/extra.json"]
    assert store.get_bytes("latest") == b"step-000001\n"
    back = tmp_path / "back.bin"
    store.get_file("step-000001/__0_0.distcp", back)
    assert sha256_file(back) == sha256_file(big)
    assert store.exists("step-000002/extra.json") and not store.exists("step-000003/x")
    assert store.delete_prefix("step-000001/") == 2
    assert [i.key for i in store.list()] == ["latest", "step-000002/extra.json"]
    with pytest.raises(ObjectMissingError):
        store.get_bytes("step-000001/manifest.json")


def test_a_listing_by_a_name_prefix_holds_exactly_the_keys_that_start_with_it(store) -> None:
    # What the checkpoint catalog asks for ("step-"): every step folder's keys, none of
    # the history segments and outputs beside them, on both backends.
    keys = [
        "latest", "metrics/step-000002-ab.jsonl", "outputs/model/x", "step-000001/manifest.json",
        "step-000010/a/b.distcp", "stepx/y", "step-/z",
    ]  # fmt: skip
    for key in keys:
        store.put_bytes(key, b"1")
    expected = sorted(k for k in keys if k.startswith("step-"))
    assert [i.key for i in store.list("step-")] == expected
    assert [i.key for i in store.list("step-00001")] == ["step-000010/a/b.distcp"]
    assert [i.key for i in store.list("metrics/")] == ["metrics/step-000002-ab.jsonl"]


def test_a_file_listing_does_not_walk_folders_outside_its_prefix(tmp_path, monkeypatch) -> None:
    storage = FileStorage(tmp_path / "store")
    for i in range(5):
        storage.put_bytes(f"metrics/step-{i:06d}.jsonl", b"1")
    storage.put_bytes("step-000001/manifest.json", b"{}")
    walked: list[str] = []
    real_walk = os.walk

    def walk(top, *args, **kwargs):
        for folder, subfolders, names in real_walk(top, *args, **kwargs):
            walked.append(Path(folder).name)
            yield folder, subfolders, names

    monkeypatch.setattr(os, "walk", walk)
    assert [i.key for i in storage.list("step-")] == ["step-000001/manifest.json"]
    assert "metrics" not in walked and "step-000001" in walked, walked


def test_a_range_past_the_end_reads_short_not_an_error(store) -> None:
    """As the Storage interface says and a file reads: fewer bytes at the object's end,
    none past it. S3 answered 416 (InvalidRange), a permanent error, for a range past
    the end of a truncated or emptied shard: resume and export failed on it instead of
    finding the damage and taking an older checkpoint."""
    store.put_bytes("step-000001/x", b"0123456789")
    store.put_bytes("step-000001/empty", b"")
    assert store.get_range("step-000001/x", 6, 8) == b"6789"
    assert store.get_range("step-000001/x", 10, 4) == b""
    assert store.get_range("step-000001/x", 64, 4) == b""
    assert store.get_range("step-000001/empty", 0, 4096) == b""
    with pytest.raises(ObjectMissingError):
        store.get_range("step-000001/gone", 0, 4)


def test_large_bytes_go_up_in_parts(s3_env, bucket) -> None:
    """A published model is one object written from memory: above the part size it is a
    multipart upload (one PUT stops at 5 GB on AWS)."""
    store = open_storage(f"s3://{bucket}/weights", s3_options(s3_env))
    data = os.urandom(12 << 20)
    store.put_bytes("v-00000001/model.safetensors", data)
    store.put_bytes("v-00000001/READY", b"{}")
    client = s3_env.client()
    etags = {
        key: client.head_object(Bucket=bucket, Key=f"weights/v-00000001/{key}")["ETag"]
        for key in ("model.safetensors", "READY")
    }
    assert etags["model.safetensors"].strip('"').endswith("-3"), etags  # 3 parts of 5 MiB
    assert "-" not in etags["READY"]  # small objects stay one PUT
    assert store.get_bytes("v-00000001/model.safetensors") == data


def test_deleting_a_key_leaves_what_other_writers_have_beside_it(tmp_path: Path) -> None:
    """Rank 0 withdraws a stale manifest while the other ranks upload their shards into
    the same folder: a key's delete must not remove their temp files or the (still
    empty) folder; a folder's delete removes everything below it."""
    store = FileStorage(tmp_path / "ckpts")
    store.put_bytes("step-000002/manifest.json", b"{}")
    folder = tmp_path / "ckpts" / "step-000002"
    in_flight = folder / f"{TEMP_MARK}0a1b-__1_0.distcp"  # another rank's upload
    in_flight.write_bytes(b"half")
    (folder / "hf").mkdir()  # made by another rank, still empty
    assert store.delete_prefix("step-000002/manifest.json") == 1
    assert in_flight.read_bytes() == b"half" and (folder / "hf").is_dir()
    assert store.delete_prefix("step-000002/") == 0
    assert not folder.exists()


def test_a_missing_bucket_is_named(s3_env) -> None:
    store = open_storage("s3://no-such-bucket/x", s3_options(s3_env))
    # (SeaweedFS creates a bucket on the first PUT, AWS does not: reads must name it.)
    with pytest.raises(BucketMissingError, match="bucket 'no-such-bucket' does not exist"):
        store.list()
    with pytest.raises(BucketMissingError, match=r"create it or fix spec\.checkpoint\.uri"):
        store.get_bytes("latest")


def test_wrong_credentials_are_reported_without_the_secret(s3_env, bucket, monkeypatch) -> None:
    wrong_secret = "totally-wrong-secret-value-1234"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
    store = open_storage(f"s3://{bucket}/x", s3_options(s3_env, max_attempts=1))
    with pytest.raises(CredentialsError, match="rejected the credentials") as error:
        store.put_bytes("a", b"1")
    text = f"{error.value!r} {error.value} {error.value.__cause__} {error.value.__context__}"
    assert wrong_secret not in text and SECRET_KEY not in text
    assert error.value.__cause__ is None and error.value.transient is False


def test_refused_credentials_are_named_whatever_the_bucket_is_called(s3_env, tmp_path) -> None:
    """An upload's error text names the bucket and key: one called "interconnect-…" was
    read as an unreachable endpoint, retried for uploadRetryMinutes, and the user told
    the endpoint was down when the credentials had been refused."""
    source = tmp_path / "shard"
    source.write_bytes(b"x" * 1024)
    os.environ["AWS_SECRET_ACCESS_KEY"], saved = "wrong-secret", os.environ["AWS_SECRET_ACCESS_KEY"]
    try:
        store = open_storage("s3://interconnect-ckpt/connector", s3_options(s3_env, max_attempts=1))
        with pytest.raises(CredentialsError, match="rejected the credentials") as refused:
            store.put_file("step-000001/__0_0.distcp", source)
    finally:
        os.environ["AWS_SECRET_ACCESS_KEY"] = saved
    assert not refused.value.transient


def test_a_client_error_no_retry_mends_is_permanent_and_named(monkeypatch) -> None:
    """botocore's own refusals carry no S3 code: they were retried to the deadline as
    transient and reported as "unknown error"."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    from rlft.trainer.storage.backends import S3Options

    endpoint = "http://minio.local:9000/?region=x"  # the job's validation refuses it now
    options = S3Options(endpoint_url=endpoint, max_attempts=1, addressing_style="path")
    with pytest.raises(StorageError, match=r"failed \(EndpointResolutionError\): ") as error:
        open_storage("s3://bucket/x", options).list()
    assert not error.value.transient


def test_credentials_from_a_mounted_secret_folder(s3_env, bucket, monkeypatch, tmp_path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "AWS_ACCESS_KEY_ID").write_text(os.environ["AWS_ACCESS_KEY_ID"])
    (secret / "AWS_SECRET_ACCESS_KEY").write_text(SECRET_KEY + "\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = open_storage(f"s3://{bucket}/x", s3_options(s3_env, credentials_dir=str(secret)))
    store.put_bytes("a", b"1")
    assert store.get_bytes("a") == b"1"


def test_credentials_rotated_in_the_mounted_folder_are_taken_up(
    s3_env, bucket, monkeypatch, tmp_path
) -> None:
    """The kubelet updates a mounted Secret when its keys are rotated; the client kept
    the keys it started with, and every save of a weeks-long run failed from then on.
    A refusal re-reads the folder: new keys there make it a transient error, retried
    with them."""
    from rlft.trainer.storage.retry import with_retries

    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "AWS_ACCESS_KEY_ID").write_text(os.environ["AWS_ACCESS_KEY_ID"])
    (secret / "AWS_SECRET_ACCESS_KEY").write_text("the-key-before-rotation")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    options = s3_options(s3_env, credentials_dir=str(secret), max_attempts=1)
    store = open_storage(f"s3://{bucket}/x", options)
    with pytest.raises(CredentialsError) as refused:
        store.put_bytes("a", b"1")
    assert not refused.value.transient  # the folder holds what the client has
    (secret / "AWS_SECRET_ACCESS_KEY").write_text(SECRET_KEY + "\n")  # rotated
    with_retries(lambda: store.put_bytes("a", b"2"), deadline_s=30)
    assert store.get_bytes("a") == b"2"


def test_an_unreachable_endpoint_is_transient(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    from seaweedfs import free_ports

    (port,) = free_ports(1)
    from rlft.trainer.storage.backends import S3Options

    store = open_storage(
        "s3://bucket/x",
        S3Options(endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1, addressing_style="path"),
    )
    with pytest.raises(StorageError, match="cannot reach") as error:
        store.put_bytes("a", b"1")
    assert error.value.transient


def test_a_download_whose_stream_keeps_breaking_is_transient(monkeypatch, tmp_path) -> None:
    """An endpoint that announces an object's size and then breaks off every transfer
    half-way: boto3 retries the reads, then gives up (RetriesExceededError), which must
    read as the transient StorageError it is, not a raw error."""
    import http.server
    import threading

    size = 1 << 20

    class Breaking(http.server.BaseHTTPRequestHandler):
        def _headers(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
            self.send_header("Last-Modified", "Thu, 03 Dec 2026 00:00:00 GMT")
            self.end_headers()

        def do_HEAD(self) -> None:
            self._headers()

        def do_GET(self) -> None:
            self._headers()
            self.wfile.write(b"x" * (size // 2))  # and the connection closes
            self.close_connection = True

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Breaking)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    from rlft.trainer.storage.backends import S3Options

    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    options = S3Options(endpoint_url=endpoint, max_attempts=1, addressing_style="path")
    try:
        store = open_storage("s3://bucket/run", options)
        with pytest.raises(StorageError, match="downloading step-000001/x") as error:
            store.get_file("step-000001/x", tmp_path / "x")
        assert error.value.transient
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 2 MiB tmpfs: writes beyond it fail with ENOSPC, as on a full volume."""
    with tmpfs(tmp_path / "tiny", "2m") as mount:
        yield mount


def test_a_full_disk_is_a_clear_error_and_leaves_nothing_behind(tiny_disk, tmp_path) -> None:
    store = FileStorage(tiny_disk)
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (3 << 20))
    with pytest.raises(StorageFullError, match=r"no space left .* spec\.checkpoint\.uri"):
        store.put_file("step-000001/__0_0.distcp", big)
    with pytest.raises(StorageFullError):
        store.put_bytes("step-000001/x", b"\0" * (3 << 20))
    leftovers = [p for p in tiny_disk.rglob("*") if p.is_file()]
    assert leftovers == []
    store.put_bytes("step-000001/small", b"fits")  # the space came back


def test_a_download_to_a_full_disk_is_a_clear_error(store, tiny_disk, tmp_path) -> None:
    """s3transfer raised the local disk's OSError as it was (no StorageError, no advice)."""
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (3 << 20))
    store.put_file("step-000001/__0_0.distcp", big)
    target = tiny_disk / "copy" / "__0_0.distcp"
    with pytest.raises(StorageFullError, match=r"no space left .* (downloading|writing)") as full:
        store.get_file("step-000001/__0_0.distcp", target)
    assert "spec.checkpoint.uri" not in str(full.value)  # the job's location is not full
    assert [p for p in tiny_disk.rglob("*") if p.is_file()] == []


def test_the_parts_of_an_upload_killed_midway_are_removed_with_its_folder(
    s3_env, bucket, tmp_path
) -> None:
    """A process SIGKILLed while its multipart upload is under way (preempted, OOM, the
    grace watchdog) leaves parts stored and billed that no listing shows; deleting the
    step folder (retention, a failed save's cleanup) aborts them."""
    import signal
    import subprocess
    import sys
    import time

    import boto3

    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(40 << 20))  # eight 5 MiB parts, one at a time
    child = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rlft.trainer.storage.backends import S3Options, open_storage\n"
        f"options = S3Options(endpoint_url={s3_env.endpoint!r}, addressing_style='path',\n"
        "                     part_size_mb=5, upload_concurrency=1)\n"
        f"open_storage('s3://{bucket}/run', options).put_file('step-000007/__0_0.distcp',\n"
        f"                                                   Path({str(big)!r}))\n"
    )
    uploader = subprocess.Popen([sys.executable, "-c", child], env=dict(os.environ))
    client = boto3.client("s3", endpoint_url=s3_env.endpoint)

    def parts() -> int:
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix="run/").get("Uploads", [])
        return sum(
            len(client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get(
                "Parts", []))
            for u in uploads
        )  # fmt: skip

    try:
        deadline = time.monotonic() + 60
        while parts() == 0:
            assert uploader.poll() is None, "the upload ended before it could be killed"
            assert time.monotonic() < deadline, "no part was ever stored"
            time.sleep(0.05)
    finally:
        uploader.send_signal(signal.SIGKILL)
        uploader.wait()
    assert parts() > 0
    store = open_storage(f"s3://{bucket}/run", s3_options(s3_env))
    assert store.list("step-000007/") == []  # invisible, yet stored
    store.delete_prefix("step-000007/")
    assert client.list_multipart_uploads(Bucket=bucket, Prefix="run/").get("Uploads", []) == []
