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

from processes import descendants_running, kill_tree, read_proc
from test_resume import (
    GRACE,
    assert_last_checkpoint_is_an_emergency_one_of_the_last_step,
    start,
    wait_for_step,
    write_long_job,
)
from trainer_holds import WAIT_FOR_ROLLOUTS, Hold

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
