"""Injected faults: a saver killed mid-upload, SIGTERM, the S3 server going away for 30 s
during training (a real SeaweedFS server, stopped and restarted), and a staging disk that
takes no more bytes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import (
    batch_for,
    s3_options,
    tiny_model,
    train_step,
    worker_command,
    worker_env,
)
from seaweedfs import SeaweedServer

from rlft.trainer.checkpoint import load, open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.saver import Checkpointer

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
OUTAGE_S = float(os.environ.get("RLFT_TEST_OUTAGE_S", "30"))


class Worker:
    """A training subprocess whose output lines are collected as they come."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no line starting {prefix!r}; output:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(5)


@pytest.fixture
def workers():
    started: list[Worker] = []

    def start(*args: str, endpoint: str | None = None) -> Worker:
        worker = Worker(worker_command(*args), worker_env(endpoint))
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def test_killed_during_upload_leaves_nothing_a_resume_would_pick(
    s3_env, bucket, workers, tmp_path: Path, monkeypatch
) -> None:
    uri = f"s3://{bucket}/run"
    worker_tmp = tmp_path / "worker-tmp"  # where the workers stage their checkpoints
    worker_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(worker_tmp))
    # Uploads of every checkpoint after the first (step 2) are slowed down so that the
    # kill lands in the middle of them; the first commits normally.
    worker = workers(
        uri,
        "--every",
        "2",
        "--slow-upload",
        "60",
        "--slow-from-step",
        "3",
        endpoint=s3_env.endpoint,
    )
    worker.wait_for("EVENT committed 2")
    second = int(worker.wait_for("UPLOADED ").split()[1].split("/")[0].removeprefix("step-"))
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.stop()
    assert worker.process.returncode == -signal.SIGKILL
    assert list(worker_tmp.glob(f"rlft-staging-*/rank-0/step-{second:06d}/*"))

    storage = open_storage(uri, s3_options(s3_env))
    scan = Catalog(storage).scan()
    assert sorted(scan.manifests) == [2] and scan.latest == 2
    assert second in scan.uncommitted  # some of its files exist, but no manifest
    model = tiny_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load(storage, "auto", model, optimizer).step == 2

    # The restarted run resumes from 2 and commits 4; retention then removes the
    # interrupted save's leftovers below it.
    again = workers(uri, "--every", "2", "--steps", "4", endpoint=s3_env.endpoint)
    assert again.process.wait(300) == 0  # a hang guard: a loaded machine took over 60 s
    again.wait_for("EVENT committed 4")
    assert again.wait_for("STEP ").startswith("STEP 3 ")  # resumed after step 2
    scan = Catalog(storage).scan()
    assert sorted(scan.manifests) == [2, 4] and scan.latest == 4
    assert scan.uncommitted == ({second} if second > 4 else set())
    assert Catalog(storage).verify(scan.manifests[4]) == []
    # The killed run's stage went when the next run started, the next run's own at its end.
    assert not list(worker_tmp.glob("rlft-staging-*"))


def test_sigterm_writes_an_emergency_checkpoint_within_the_grace_period(
    s3_env, bucket, workers
) -> None:
    uri = f"s3://{bucket}/run"
    grace = 20.0
    worker = workers(
        uri,
        "--every",
        "1000",
        "--grace",
        str(grace),
        "--step-seconds",
        "0.05",
        endpoint=s3_env.endpoint,
    )
    worker.wait_for("STEP 3 ")
    sent = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(grace + 10) == 0
    elapsed = time.monotonic() - sent
    assert elapsed < grace
    report = json.loads(worker.wait_for('{"stopped_at"'))
    assert report["committed"] is True
    scan = Catalog(open_storage(uri, s3_options(s3_env))).scan()
    step = report["stopped_at"]
    assert scan.latest == step and scan.manifests[step].emergency
    assert Catalog(open_storage(uri, s3_options(s3_env))).verify(scan.manifests[step]) == []


def test_sigterm_while_a_save_retries_an_outage_still_ends_with_a_verdict(
    s3_env, bucket, workers
) -> None:
    """SIGTERM while a scheduled save retries uploads the store refuses: the emergency
    checkpoint first waited out that save's own deadline (uploadRetryMinutes, 15 min by
    default), the grace watchdog fired, and the run exited 1 without a verdict. The save
    in flight must give up within the grace left, and the run exit 0 saying that its
    emergency checkpoint failed."""
    from s3_proxy import S3Proxy

    uri, grace = f"s3://{bucket}/run", 15.0
    proxy = S3Proxy(s3_env.endpoint)
    try:
        proxy.refuse("/")  # every upload answered 503: a store that is down for writes
        worker = workers(
            uri,
            "--every",
            "2",
            "--grace",
            str(grace),
            "--step-seconds",
            "0.1",
            endpoint=proxy.url,
        )
        worker.wait_for("EVENT retry 2")
        sent = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        # Exit 0 says the grace was kept: its watchdog ends a worker still at work when
        # it runs out, with exit 1. The bound is the exit's, loose for a loaded machine.
        assert worker.process.wait(grace + 30) == 0, "\n".join(worker.lines[-20:])
        assert time.monotonic() - sent < grace + 20
    finally:
        proxy.stop()
    report = json.loads(worker.wait_for('{"stopped_at"'))
    assert report["committed"] is False
    assert "EVENT failed 2" in worker.lines  # the save in flight gave up, then the stop's
    assert f"EVENT failed {report['stopped_at']}" in worker.lines
    assert Catalog(open_storage(uri, s3_options(s3_env))).scan().manifests == {}


def test_an_s3_outage_during_training_is_retried_and_the_save_commits_later(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The store goes away for OUTAGE_S seconds (30 by default) while a checkpoint is
    being uploaded: training keeps stepping, the upload is retried (counted and logged)
    and the checkpoint commits once the store is back."""
    from seaweedfs import ACCESS_KEY, SECRET_KEY

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    server = SeaweedServer(tmp_path / "data", tmp_path / "weed.log")
    server.start()
    try:
        server.create_bucket("outage")
        storage = open_storage("s3://outage/run", s3_options(server, connect_timeout_s=1.0))
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        events: list[tuple[str, int | None]] = []
        ckpt = Checkpointer(
            storage,
            interval_steps=2,
            retry_seconds=OUTAGE_S + 60,
            on_event=lambda name, info: events.append((name, info.get("step"))),
        )
        caplog.set_level(logging.INFO, logger="rlft.checkpoint")
        step = 0
        down_at = None
        steps_while_down = 0
        while True:
            step += 1
            train_step(model, optimizer, batch_for(step))
            if step == 2:
                server.stop()  # the outage starts just before the save
                down_at = time.monotonic()
            if down_at is not None and server.process is None:
                steps_while_down += 1
                if time.monotonic() - down_at >= OUTAGE_S:
                    server.start()
            decision = ckpt.poll(step)
            if decision.save:
                ckpt.save(step, model, optimizer, extra={"step": step})
            if ckpt.stats.committed:
                break
            assert time.monotonic() - (down_at or time.monotonic()) < OUTAGE_S + 60, events
            time.sleep(0.05)
        ckpt.close()
    finally:
        server.stop()
    assert steps_while_down > 20  # training went on during the outage
    first = next(i for i, (name, _) in enumerate(events) if name == "committed")
    assert events[first] == ("committed", 2), events
    assert ckpt.stats.upload_retries >= 2 and events[0] == ("retry", 2)
    assert "failed" not in [name for name, _ in events]
    assert ckpt.stats.deferred > 0  # the saves due at 4, 6, … waited for the first
    assert "failed (attempt 1)" in caplog.text and "retrying in" in caplog.text
    assert "step-000002 committed" in caplog.text and "retries so far" in caplog.text


FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
import torch
from checkpoint_fixtures import tiny_model
from rlft.trainer.checkpoint import open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.saver import Checkpointer

events = []
storage = open_storage(sys.argv[1])
saver = Checkpointer(storage, on_event=lambda name, info: events.append([name, info]))
model = tiny_model(0)
optimizer = torch.optim.AdamW(model.parameters())
# Files of at most 100 kB from now on (a shard is ~550 kB): writes past it fail with
# EFBIG, as on a full disk, in DCP's writer.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
found = {"async": saver.save(2, model, optimizer, extra={}, wait=False)}
saver.wait()
found["sync"] = saver.save(4, model, optimizer, extra={}, wait=True)
found["failed"] = saver.stats.failed
found["stage"] = sorted(p.name for p in saver.staging_dir.iterdir())
scan = Catalog(storage).scan()
found["location"] = [sorted(scan.manifests), sorted(scan.uncommitted)]
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
found["after"] = saver.save(6, model, optimizer, extra={}, wait=True)
found["events"] = events
saver.close()
print(json.dumps(found))
"""


def test_a_staging_disk_that_takes_no_more_bytes_fails_the_save_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """DCP reports a failed write as CheckpointException, a BaseException: it used to
    escape the saver's handling, killing an async save's thread (no failure counted or
    reported, its partial shards left in the stage) and a synchronous save's caller."""
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, f"file://{tmp_path}/ckpt"],
        cwd=Path(__file__).parent,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["async"] is False and found["sync"] is False and found["failed"] == 2
    assert found["stage"] == [".lock"]  # the partial shards went with the failed saves
    assert found["location"] == [[], []]  # nothing of them at the location
    assert found["after"] is True  # the next save, with room again, commits
    failed = [info for name, info in found["events"] if name == "failed"]
    assert [info["step"] for info in failed] == [2, 4]
    assert all("DCP write on rank 0: RuntimeError" in info["error"] for info in failed)
    assert "Traceback" not in done.stderr


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_synchronous_save_and_a_slow_resume_are_progress(tmp_path: Path) -> None:
    """A pause's or the run's last save (synchronous) and a rollback's restore run inside
    the judged loop: their files took longer than stallTimeoutSeconds together, and the
    rank was declared stalled (killed mid-save) because nothing beat meanwhile."""
    from rlft.trainer.checkpoint import loader
    from rlft.trainer.telemetry import liveness
    from rlft.trainer.telemetry.liveness import Liveness

    clock = _Clock()
    before = liveness.current()
    liveness.install(Liveness(60, clock=clock))
    sha256 = loader.sha256_file
    try:
        liveness.begin()
        storage = open_storage(f"file://{tmp_path}/ckpts")
        put_file = storage.put_file

        def slow_put_file(key, path, *, move=False):  # each file takes 40 "seconds"
            put_file(key, path, move=move)
            clock.now += 40
            time.sleep(1.2)  # real time, for the waiting thread to see it

        storage.put_file = slow_put_file
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = Checkpointer(storage, keep_last=10)
        assert ckpt.save(2, model, optimizer, extra={"step": 2}, wait=True)
        ckpt.close()
        assert clock.now - 1000 > 2 * 60  # longer than the stall timeout
        assert liveness.current().state().alive, liveness.current().state()

        def slow_sha256(path):  # each file checked on resume takes 40 "seconds"
            clock.now += 40
            return sha256(path)

        loader.sha256_file = slow_sha256
        checked_from = clock.now
        assert load(storage, "auto", tiny_model(), None).step == 2
        assert clock.now - checked_from > 60
        assert liveness.current().state().alive, liveness.current().state()
    finally:
        loader.sha256_file = sha256
        liveness.install(before)
