"""Ctrl-C on a local `rlft train` is a user's SIGTERM: the step in hand finishes, its
emergency checkpoint commits, the run exits 0, and `rlft train` again resumes from it.
A second Ctrl-C stops at once without one. The signal is sent as a terminal sends it: to
the foreground process group, which with `--nproc` holds `rlft train` alone (torchrun runs
in a group of its own, and each of its workers in a session of its own): `rlft train`
passes it on to the workers."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time

import pytest
from processes import descendants, descendants_running, kill_tree, read_proc
from test_resume import (
    assert_last_checkpoint_is_an_emergency_one_of_the_last_step,
    checkpoint_rows,
    start,
    wait_for_step,
    write_long_job,
)

from rlft.trainer.distributed.launch import child_pids
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
        self.reader = threading.Thread(
            target=lambda: [self.lines.put(x) for x in process.stdout], daemon=True
        )
        self.reader.start()

    def wait_for(self, marker: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.text:
            self.text += self.lines.get(timeout=max(0.1, deadline - time.monotonic()))

    def rest(self) -> str:
        """The whole output, once the process has exited: the reader ends at the pipe's
        EOF (when the process and any rank left of it are gone), having queued every line
        however long a loaded machine took to read them."""
        self.reader.join(timeout=30)
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


def _started_torchrun(process: subprocess.Popen, timeout: float = 60) -> int:
    """torchrun's process id, as soon as `rlft train --nproc` has started it (it then
    imports torch for a second or more before it starts any worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        agent = child_pids(process.pid)
        if agent:
            return agent[0]
        time.sleep(0.01)
    raise AssertionError(f"rlft train started no torchrun: {process.communicate()[0]}")


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_a_stop_before_the_ranks_started_ends_at_once_without_a_traceback(tmp_path, stop):
    """Nothing has run to checkpoint: `rlft train --nproc` stops torchrun at once and
    exits with the shell's code for the signal (it used to hand the signal to torchrun,
    which ended in a traceback of its own)."""
    write_long_job(tmp_path)
    process = start(tmp_path, "out", "--nproc", "2", start_new_session=True)
    try:
        agent = _started_torchrun(process)
        assert not child_pids(agent), "torchrun started its workers before the signal"
        signum = signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM
        if stop == "ctrl-c":
            _ctrl_c(process)
        else:
            process.send_signal(signum)
        output = process.communicate(timeout=30)[0]
        left = [pid for pid in [agent, *descendants(process.pid)] if read_proc(pid, "cmdline")]
    finally:
        kill_tree(process)
    assert process.returncode == 128 + signum, output
    assert f"rlft: stopped: {signum.name} before the workers started" in output, output
    assert "Traceback" not in output, output
    assert not left, (left, output)


def test_torchrun_killed_outright_leaves_no_rank_training(tmp_path):
    """torchrun SIGKILLed (the OOM killer, a `kill -9`): its workers, each in a session
    of its own, used to train on unseen beside a rerun writing the same folder. `rlft
    train` is their reaper: it kills them and exits 1. (Rank 0 hangs at step 3, and rank 1
    waits for it in the step's collective: left alone, both would run for good.)"""
    write_long_job(tmp_path)
    hang = '[{"kind": "hang", "rank": 0, "at": 3}]'
    process = start(tmp_path, "out", "--nproc", "2", env={faults.ENV: hang}, start_new_session=True)
    output = _Output(process)
    ranks: list[int] = []
    try:
        output.wait_for("planted fault: rank 0 hangs")
        (agent,) = descendants_running(process.pid, "torch.distributed.run")
        ranks = child_pids(agent)
        assert len(ranks) == 2, ranks
        os.kill(agent, signal.SIGKILL)
        process.wait(timeout=30)
        left = _still_running(ranks)
    finally:
        kill_tree(process)
        for pid in ranks:  # orphans are no descendants of the run any more
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    text = output.rest()
    assert process.returncode == 1, text
    assert not left, (left, text)


def _still_running(pids: list[int], timeout: float = 15) -> list[int]:
    """Those of `pids` still running after up to `timeout` seconds: a SIGKILLed process
    may take a while to go on a loaded machine (torch's threads, its memory freed),
    while a rank left training is still there at the end."""
    deadline = time.monotonic() + timeout
    left = [pid for pid in pids if read_proc(pid, "cmdline")]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if read_proc(pid, "cmdline")]
    return left
