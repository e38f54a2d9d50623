"""SIGTERM to a rank other than 0 while rank 0 waits for rollouts that do not come: the
rank waits for rank 0 in a collective, where its own handler cannot run. Its signal
reaches rank 0 through the process group's store, rank 0 stops waiting, and both ranks
checkpoint the step they finished, inside the grace period. Before, the signalled rank
learned of its SIGTERM only when rank 0's wait ended, and its watchdog ended it at the
grace with no checkpoint (a preempted pod of a gang, the rollout pods slow)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import yaml
from checkpoint_fixtures import s3_options
from processes import descendants_running, kill_tree, read_proc
from test_resume import (
    GRACE,
    assert_last_checkpoint_is_an_emergency_one_of_the_last_step,
    start,
    wait_for_step,
    write_job,
    write_long_job,
)
from trainer_holds import FINAL_CHECKPOINT, WAIT_FOR_ROLLOUTS, Hold

from rlft.trainer.checkpoint import open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.manifest import LATEST


def _rank(pid: int) -> int | None:
    for entry in read_proc(pid, "environ").split(b"\0"):
        if entry.startswith(b"RANK="):
            return int(entry[5:])
    return None


def test_sigterm_to_rank_1_while_rank_0_waits_for_rollouts_checkpoints_at_once(tmp_path):
    write_long_job(tmp_path, grace=GRACE, rollout_server=True)
    hold = Hold(tmp_path, WAIT_FOR_ROLLOUTS)
    process = start(tmp_path, "out", "--nproc", "2")
    servers: list[int] = []
    try:
        wait_for_step(tmp_path / "out", 3, process)
        servers = descendants_running(process.pid, "rlft.trainer.rollout.server")
        workers = descendants_running(process.pid, "rlft.trainer.cli.main")
        rank_1 = [pid for pid in workers if _rank(pid) == 1]
        assert len(servers) == 1 and len(rank_1) == 1, (servers, workers)
        os.kill(servers[0], signal.SIGSTOP)  # rank 0 waits for a batch that never comes
        # Until rank 0 is in that wait (a step may take more than any sleep), and then
        # until the stop reaches it: a batch still in flight cannot end the wait first.
        hold.arm()
        hold.wait(process)
        sent = time.monotonic()
        os.kill(rank_1[0], signal.SIGTERM)  # its pod preempted, rank 0's not
        checkpoints = tmp_path / "out" / "checkpoints"
        while not (checkpoints / LATEST).exists() and time.monotonic() - sent < GRACE + 10:
            assert process.poll() is None or process.returncode == 0, process.stdout.read()
            time.sleep(0.2)
        committed_after = time.monotonic() - sent
        os.kill(servers[0], signal.SIGCONT)
        output = process.communicate(timeout=90)[0]
    finally:
        if process.poll() is None:
            kill_tree(process)
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # Rank 1's watchdog would have ended it at the grace's end, with no checkpoint.
    assert committed_after < GRACE, (committed_after, output)
    assert process.returncode == 0, output
    assert "stopping while waiting for rollouts; checkpointing step" in output, output
    assert_last_checkpoint_is_an_emergency_one_of_the_last_step(tmp_path / "out")


FINAL_GRACE = 60
"""Rank 0's grace in the final wait: what ends the run (the final checkpoint, the final
evaluation, the model written and copied) comes after rank 1 gave up, in what is left,
on however slow a machine; far below rank 1's own 10 minutes of retries still."""


def test_sigterm_to_rank_0_alone_ends_rank_1s_save_retries_within_its_grace(
    tmp_path, s3_env, bucket, store_proxy
):
    """The other way round: rank 0's pod preempted, rank 1's not, while rank 1 retries
    the upload of its step-2 shard (the store refuses it) in the run's final wait for
    the save in flight. Rank 1 had no step's collective to learn of the stop in: it
    retried for its whole uploadRetryMinutes while rank 0, waiting for its shards to
    commit, ran out of grace, and its watchdog ended the run with exit 1 and without the
    final checkpoint. Now rank 1 reads the stop and its time from the group's store and
    gives up within rank 0's grace, and the final checkpoint commits in it."""
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = 6
    spec["spec"]["eval"] = {"maxProblems": 4}  # what ends the run comes after the save
    spec["spec"]["checkpoint"] = {
        "uri": f"s3://{bucket}/run",
        "endpointUrl": store_proxy.url,
        "addressingStyle": "path",
        "intervalSteps": 2,
        "uploadRetryMinutes": 10,
        "gracePeriodSeconds": FINAL_GRACE,
    }
    job.write_text(yaml.safe_dump(spec))
    store_proxy.refuse("/step-000002/__1_")  # rank 1's step-2 shard: answered 503
    hold = Hold(tmp_path, FINAL_CHECKPOINT)
    process = start(tmp_path, "out", "--nproc", "2")
    try:
        hold.wait(process)  # rank 0 at its final checkpoint; rank 1 in the wait
        workers = descendants_running(process.pid, "rlft.trainer.cli.main")
        (rank_0,) = [pid for pid in workers if _rank(pid) == 0]
        sent = time.monotonic()
        os.kill(rank_0, signal.SIGTERM)
        output = process.communicate(timeout=FINAL_GRACE + 60)[0]
        ended_after = time.monotonic() - sent
    finally:
        if process.poll() is None:
            kill_tree(process)
    assert process.returncode == 0, output
    assert ended_after < FINAL_GRACE, (ended_after, output)
    assert "checkpoint at step 2 failed and was not committed" in output, output
    storage = open_storage(f"s3://{bucket}/run", s3_options(s3_env))
    assert Catalog(storage).scan().latest == 6, output
