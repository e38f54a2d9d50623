"""Ctrl-C on a local `rlft train` is a user's SIGTERM: the step in hand finishes, its
emergency checkpoint commits, the run exits 0, and `rlft train` again resumes from it.
A second Ctrl-C stops at once without one. The signal is sent as a terminal sends it: to
the foreground process group, which with `--nproc` holds `rlft train` alone (torchrun runs
in a group of its own, and each of its workers in a session of its own): `rlft train`
passes it on to the workers."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time

import pytest
from processes import descendants_running, kill_tree, read_proc
from test_resume import (
    assert_last_checkpoint_is_an_emergency_one_of_the_last_step,
    checkpoint_rows,
    start,
    wait_for_step,
    write_long_job,
)

from rlft.trainer.learner import faults
from rlft.trainer.storage.backends import open_storage


def _ctrl_c(process: subprocess.Popen) -> None:
    """What a terminal does: SIGINT to the foreground process group (the test started the
    run in a session of its own, so that group is the run's alone)."""
    os.killpg(process.pid, signal.SIGINT)


class _Output:
    """The process's output, read on a thread so a test can wait for a line."""

    def __init__(self, process: subprocess.Popen):
        self.lines: queue.Queue[str] = queue.Queue()
        self.text = ""
        threading.Thread(
            target=lambda: [self.lines.put(x) for x in process.stdout], daemon=True
        ).start()

    def wait_for(self, marker: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.text:
            self.text += self.lines.get(timeout=max(0.1, deadline - time.monotonic()))

    def rest(self) -> str:
        time.sleep(0.5)  # the reader's last lines
        while not self.lines.empty():
            self.text += self.lines.get()
        return self.text


def test_ctrl_c_checkpoints_the_step_in_hand_and_the_next_run_resumes_from_it(tmp_path):
    write_long_job(tmp_path)
    process = start(tmp_path, "out", start_new_session=True)
    try:
        wait_for_step(tmp_path / "out", 3, process)
        sent = time.monotonic()
        _ctrl_c(process)
        output = process.communicate(timeout=60)[0]
        took = time.monotonic() - sent
    finally:
        kill_tree(process)
    assert process.returncode == 0, output
    assert took < 30, output
    assert "Ctrl-C: emergency checkpoint" in output and "Traceback" not in output, output
    step = assert_last_checkpoint_is_an_emergency_one_of_the_last_step(tmp_path / "out")

    again = start(tmp_path, "out", "--max-steps", str(step + 1))
    output = again.communicate(timeout=300)[0]
    assert again.returncode == 0, output
    assert f"resumed from the checkpoint of step {step}" in output, output


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm", "hangup"])
def test_a_stop_on_several_ranks_checkpoints_and_exits_0(tmp_path, stop):
    """`rlft train --nproc 2`: a Ctrl-C, a SIGTERM to `rlft train` alone (`timeout`, a
    service manager) or a terminal's hangup (SIGHUP to its foreground group) reaches the
    workers, which checkpoint, and torchrun ends with them, without a traceback of its
    own. `rlft train` waits for them: it used to raise on Ctrl-C and kill torchrun
    mid-checkpoint, and to die of a SIGTERM, its ranks running on."""
    write_long_job(tmp_path)
    process = start(tmp_path, "out", "--nproc", "2", start_new_session=True)
    try:
        wait_for_step(tmp_path / "out", 3, process)
        if stop == "ctrl-c":
            _ctrl_c(process)
        elif stop == "hangup":
            os.killpg(process.pid, signal.SIGHUP)
        else:
            process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=120)[0]
    finally:
        kill_tree(process)
    assert process.returncode == 0, output
    assert "Traceback" not in output, output  # torchrun's own, when it had the signal
    assert_last_checkpoint_is_an_emergency_one_of_the_last_step(tmp_path / "out")


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_ctrl_c_stops_a_hung_step_at_once_without_a_checkpoint(tmp_path, nproc):
    """The step in hand never ends (rank 0 hangs; with `--nproc 2` rank 1 blocks in the
    step's collective): the first Ctrl-C waits for it, the second ends the run at once
    with 130, and the scheduled checkpoint stays the latest (the watchdog would have
    waited out the 60 s grace and exited 1; with `--nproc`, torchrun passes on only the
    first Ctrl-C, and would have waited 30 s before killing the ranks)."""
    write_long_job(tmp_path, interval=2)
    hang = '[{"kind": "hang", "rank": 0, "at": 4}]'
    ranks_arg = ["--nproc", str(nproc)] if nproc > 1 else []
    process = start(tmp_path, "out", *ranks_arg, env={faults.ENV: hang}, start_new_session=True)
    output = _Output(process)
    try:
        checkpoints = open_storage(str(tmp_path / "out" / "checkpoints"))
        output.wait_for("planted fault: rank 0 hangs")
        wait_for_step(tmp_path / "out", 3, process, checkpoints)
        _ctrl_c(process)
        output.wait_for("Ctrl-C again stops at once")
        agent = descendants_running(process.pid, "torch.distributed.run")
        ranks = [
            pid
            for pid in [process.pid, *descendants_running(process.pid, "rlft.trainer.cli.main")]
            if pid not in agent
        ]
        assert len(ranks) == nproc + (nproc > 1), ranks  # `rlft train` is rank 0 alone
        sent = time.monotonic()
        _ctrl_c(process)
        process.wait(timeout=40)
        took = time.monotonic() - sent
        ranks_left = [pid for pid in ranks if read_proc(pid, "cmdline")]
    finally:
        kill_tree(process)
    text = output.rest()
    assert process.returncode == 130, text
    assert took < 15, text
    assert not ranks_left, (ranks_left, text)
    assert "rlft: interrupted" in text, text
    rows = checkpoint_rows(tmp_path / "out")
    assert rows[-1][0] == "2" and rows[-1][-1] == "latest", rows  # not an emergency one
