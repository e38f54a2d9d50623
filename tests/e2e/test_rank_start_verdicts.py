"""A trainer rank that ends before training begins still leaves a verdict: one whose
process group cannot be formed (retryable failure, the cause named), one SIGTERM
reaches while it waits for its peers in the rendezvous (a retryable failure that says
nothing had run). Both used to end without a word, the operator left with torchrun's
exit 1 and a log tail.

Each runs one real rank as torchrun starts it (its environment), without torchrun: rank 0
of two, whose peer never comes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from processes import kill_tree
from tiny_jobs import arithmetic_rl_spec, write_parity_job

from rlft.trainer import termination

ENDS_WITHIN_S = 240
"""Far past starting torchrun and ranks that import torch on a loaded machine (at 60 s,
a whole process start on a 2-3x slower CI machine was closer than it looked), far below
the group's 600 s timeout."""


@pytest.fixture
def start_rank(tmp_path: Path) -> Iterator[Callable[[int], subprocess.Popen]]:
    """Start `rlft train` as rank 0 of a world of 2 whose store is at 127.0.0.1:port."""
    write_parity_job(tmp_path, arithmetic_rl_spec({"name": "grpo", "groupSize": 4}))
    started: list[subprocess.Popen] = []

    def start(port: int) -> subprocess.Popen:
        env = dict(
            os.environ,
            PYTHONPATH=str(tmp_path),
            OMP_NUM_THREADS="1",
            TORCHELASTIC_RUN_ID="rank-start-verdicts",
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        env[termination.ENV] = str(tmp_path / "out.termination")
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 serves the store itself
        command = [sys.executable, "-m", "rlft.trainer.cli.main", "train", "job.yaml"]
        process = subprocess.Popen(
            [*command, "--out", "out"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        kill_tree(process)


def ended(process: subprocess.Popen, within_s: float) -> str:
    try:
        return process.communicate(timeout=within_s)[0]
    except subprocess.TimeoutExpired:
        kill_tree(process)
        raise AssertionError(
            f"still running after {within_s:.0f} s:\n{process.communicate()[0][-3000:]}"
        ) from None


def verdict_in(folder: Path) -> termination.Verdict | None:
    path = folder / "out.termination"
    return termination.read(path.read_text()) if path.exists() else None


def test_a_rank_that_cannot_join_its_process_group_says_why(tmp_path, start_rank):
    # The store's port is taken: rank 0 cannot serve it, as when a stale process of an
    # earlier attempt holds it.
    with socket.create_server(("127.0.0.1", 0)) as taken:
        process = start_rank(taken.getsockname()[1])
        output = ended(process, ENDS_WITHIN_S)
    assert process.returncode == 1, output
    verdict = verdict_in(tmp_path)
    assert verdict is not None, output
    assert verdict.exit_code == 1 and verdict.rank == 0 and not verdict.stopped, verdict
    assert verdict.message.startswith("could not join the process group: "), verdict
    assert "address already in use" in verdict.message, verdict


def listening(port: int) -> bool:
    """Whether something on this machine listens on TCP `port` (read from /proc: a
    connection would be a client of the store)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "0A":
                return True
    return False


def test_sigterm_while_a_rank_waits_for_its_peers_stops_it_at_once_with_a_verdict(
    tmp_path, start_rank
):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    process = start_rank(port)
    deadline = time.monotonic() + ENDS_WITHIN_S
    while not listening(port):
        assert process.poll() is None, process.communicate()[0]
        assert time.monotonic() < deadline, "rank 0 never served its store"
        time.sleep(0.05)
    # Inside the store's C++ wait for rank 1, which never comes: no Python code of the
    # main thread runs there until the group's timeout, ten minutes on.
    time.sleep(0.5)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output = ended(process, 20)
    assert time.monotonic() - signalled < 10, output
    assert process.returncode == 1, output
    verdict = verdict_in(tmp_path)
    assert verdict is not None, output
    # A retryable failure, not a stop: a peer's death sends the same SIGTERM (below).
    assert verdict.exit_code == 1 and not verdict.stopped and verdict.rank == 0, verdict
    assert "stopped while starting (SIGTERM before training began)" in verdict.message
    assert verdict.last_checkpoint is None, verdict


def test_a_peer_that_never_comes_is_a_rendezvous_failure_to_the_operator(tmp_path):
    # Rank 0's store times out waiting for rank 1 (torch's own error, after 1 s here, 600
    # s in a job): the verdict the worker writes for it, read back from the termination
    # message by the operator's failure policy, restarts the gang as a rendezvous failure
    # (not a plain error), which waits for capacity while a peer has no node.
    from datetime import timedelta

    import torch.distributed as dist

    from rlft.operator.failures import RENDEZVOUS, classify
    from rlft.operator.observe import PodView
    from rlft.trainer.cli.training import join_failure

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(dist.DistStoreError) as raised:
        dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=1), wait_for_workers=True)
    path = tmp_path / "termination"
    termination.write(join_failure(raised.value, rank=0), {termination.ENV: str(path)})
    message = path.read_text()
    pod = PodView(
        name="job-trainer-0", uid="u0", role="trainer", index=0, phase="Failed",
        exit_code=1, terminated_reason="Error", message=message,
        verdict=termination.read(message),
    )  # fmt: skip
    failure = classify(pod)
    assert failure is not None and failure.kind == RENDEZVOUS and failure.group, (failure, message)
    assert "waiting for clients" in failure.message, failure


def test_a_command_line_the_trainer_does_not_know_is_a_verdict_the_operator_shows(tmp_path):
    """An operator newer than the trainer's image passes a flag the image does not know:
    argparse's exit 2 came without a verdict, and the job failed for good with nothing
    to show but a log tail. The refusal is the verdict now, read by the operator's own
    failure policy as the kubelet reports the container's end."""
    from test_secrets_in_errors import ended_trainer_pod

    from rlft.operator import failures
    from rlft.operator.observe import pod_view

    job = write_parity_job(tmp_path, arithmetic_rl_spec({"name": "grpo", "groupSize": 4}))
    log = tmp_path / "termination"
    env = dict(os.environ, RANK="1", **{termination.ENV: str(log)})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlft.trainer.cli",
            "train",
            str(job),
            "--flag-of-a-newer-operator",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=ENDS_WITHIN_S,
    )
    assert done.returncode == 2, done.stderr
    assert "unrecognized arguments: --flag-of-a-newer-operator 1" in done.stderr
    verdict = termination.read(log.read_text())
    assert verdict is not None and (verdict.exit_code, verdict.rank) == (2, 1), verdict
    assert "unrecognized arguments: --flag-of-a-newer-operator 1" in verdict.message, verdict
    failure = failures.classify(pod_view(ended_trainer_pod(2, log.read_text())))
    assert (
        failure is not None
        and "unrecognized arguments: --flag-of-a-newer-operator 1" in failure.message
    )
