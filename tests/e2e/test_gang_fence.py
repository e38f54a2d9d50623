"""Two real trainers of one job at one checkpoint location, as when the operator lost
contact with a node and started a new gang while the old one, only cut off, trained on:
the newer gang (a higher $RLFT_GANG_ATTEMPT) claims the location before it resumes, the
older one stops at its next save (exit 1, saying why) without committing, and every
checkpoint after the newer gang's resume is its own."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import yaml
from test_resume import start, write_job

from rlft.trainer.checkpoint import open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.fence import Fence


def _job(folder: Path, location: str, max_problems: int) -> None:
    """The resume test's job, long, checkpointing every 2 steps at `location`; the
    gangs' job files differ in eval.maxProblems only, so their manifests' config hashes
    tell whose each checkpoint is. A collapse only alerts: the old gang must train on
    until the new one claims the location, however long the new one takes to start (a
    rollback budget spent first ended it with exit 3 on a loaded machine)."""
    folder.mkdir()
    job = write_job(folder, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = 5000
    spec["spec"]["eval"] = {"maxProblems": max_problems}
    spec["spec"]["checkpoint"] = {"uri": location, "intervalSteps": 2, "keepLast": 2}
    spec["spec"]["stability"] = {"onCollapse": "alert"}
    job.write_text(yaml.safe_dump(spec))


def _wait(condition, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.2)


def test_a_newer_gang_stops_the_older_one_and_keeps_the_location(tmp_path) -> None:
    location = f"file://{tmp_path}/checkpoints"
    _job(tmp_path / "old", location, max_problems=20)
    _job(tmp_path / "new", location, max_problems=19)
    catalog = Catalog(open_storage(location))
    uid = {"RLFT_JOB_UID": "0f1e2d3c-job"}
    old = start(tmp_path / "old", "out", env={**uid, "RLFT_GANG_ATTEMPT": "0"})
    new = None
    try:
        _wait(lambda: catalog.scan().latest is not None or old.poll() is not None, "a commit")
        assert old.poll() is None, old.communicate()[0]
        first = catalog.scan()  # one scan: `latest` moves on meanwhile
        old_hash = first.manifests[first.latest].config_hash
        new = start(tmp_path / "new", "out", env={**uid, "RLFT_GANG_ATTEMPT": "1"})
        output = old.communicate(timeout=240)[0]
        assert old.returncode == 1, output
        assert "attempt 0 was replaced by attempt 1" in output, output

        def new_commits() -> list[int]:
            found = catalog.scan().manifests.values()
            return sorted(m.step for m in found if m.config_hash != old_hash)

        _wait(lambda: len(new_commits()) >= 2 or new.poll() is not None, "the new gang's")
        new.send_signal(signal.SIGTERM)
        new_output = new.communicate(timeout=120)[0]
        assert new.returncode == 0, new_output
    finally:
        for process in (old, new):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    scan = catalog.scan()
    ours = new_commits()
    assert scan.latest == ours[-1], (scan.latest, ours)
    theirs = [m.step for m in scan.manifests.values() if m.config_hash == old_hash]
    assert all(step < ours[0] for step in theirs), (theirs, ours)
    assert Fence(catalog.storage, "0f1e2d3c-job", 0).newest() == 1
