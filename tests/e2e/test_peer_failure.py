"""A step that fails on one rank alone (a ValueError in a batch only it holds, a bug on
rank 0's rollout or reward path) while its peer waits for it in the step's collective:
the run ends at once with exit 1 and the failing rank's own words as the verdict. The
failed rank used to wait for its peers in the goodbye barrier, which they never reached
(they wait in the step's collective for it): both hung until the process group's
timeout (10 minutes at least) before torchrun saw anything."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from processes import kill_tree
from test_resume import start, write_job

from rlft.trainer import termination

ENDS_WITHIN_S = 90
"""From the first step on: far past a step here, far below the group's 600 s timeout."""


def _first_step_or_end(out: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until step 1 is in metrics.jsonl or the run ended: the start (torchrun, two ranks
    importing torch, the warm start) is the machine's speed, not what a test times."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()) and process.poll() is None:
        assert time.monotonic() < deadline, "step 1 never came"
        time.sleep(0.05)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_failing_on_one_rank_ends_the_run_at_once_with_its_verdict(tmp_path, rank):
    write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    planted = json.dumps([{"kind": "error", "rank": rank, "at": 2}])
    process = start(tmp_path, "out", "--nproc", "2", env={"RLFT_PLANT_FAULTS": planted})
    try:
        _first_step_or_end(tmp_path / "out", process)
        started = time.monotonic()
        output = process.communicate(timeout=ENDS_WITHIN_S)[0]
    except subprocess.TimeoutExpired:
        kill_tree(process)
        output = process.communicate()[0]
        raise AssertionError(
            f"still running {time.monotonic() - started:.0f} s after rank {rank} failed:\n"
            + output[-3000:]
        ) from None
    finally:
        if process.poll() is None:
            kill_tree(process)
    assert process.returncode == 1, output
    assert f"step 2 failed: planted fault: rank {rank} fails at step 2" in output, output
    verdict = termination.read((tmp_path / "out.termination").read_text())
    assert verdict is not None and verdict.exit_code == 1, verdict
    assert f"rank {rank} fails at step 2" in verdict.message, verdict


def test_the_survivor_of_a_rank_killed_outright_writes_its_verdict(tmp_path):
    """Rank 1 SIGKILLed mid-run: rank 0's collective breaks, and torchrun SIGTERMs it
    within a tenth of a second, as it ends. Its run's signal handler was gone by then, and
    SIGTERM's default action killed it before it wrote its verdict (exit -15, no line:
    the operator had exit 1 and a log tail). It now writes it, then ends."""
    import os
    import signal

    from processes import descendants, read_proc
    from test_resume import wait_for_step

    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = 400
    job.write_text(yaml.safe_dump(spec))
    process = start(tmp_path, "out", "--nproc", "2")
    try:
        wait_for_step(tmp_path / "out", 2, process)
        (rank_1,) = [
            pid for pid in descendants(process.pid) if b"RANK=1\0" in read_proc(pid, "environ")
        ]
        os.kill(rank_1, signal.SIGKILL)
        output = process.communicate(timeout=ENDS_WITHIN_S)[0]
    finally:
        if process.poll() is None:
            kill_tree(process)
    assert process.returncode == 1, output
    text = (tmp_path / "out.termination").read_text()
    ranks = [json.loads(line) for line in text.splitlines() if termination.MARK in line]
    assert [line["rank"] for line in ranks] == [0], text  # rank 1 had no time for one
    assert ranks[0]["exit_code"] == 1 and ranks[0]["message"], ranks


def test_an_error_after_the_last_step_is_retryable_not_the_jobs_configuration(
    tmp_path, monkeypatch
):
    """A ValueError once the steps are done (the final model's save, say) ended the run
    with exit 2, which the operator takes for a job that can never run: no restart, and
    the failure blamed on its configuration. A job that trained is not misconfigured."""
    import rlft.trainer.run.job as job_module
    from rlft.trainer.cli.main import main

    def failing_finish(run, *args):
        raise ValueError("the final save found something wrong")

    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = 1
    spec["spec"]["algorithm"]["sft"] = {"steps": 0}
    job.write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(job_module, "_finish", failing_finish)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(termination.ENV, str(tmp_path / "out.termination"))
    assert main(["train", str(job), "--out", str(tmp_path / "out")]) == 1
    verdict = termination.read((tmp_path / "out.termination").read_text())
    assert verdict is not None and verdict.exit_code == 1, verdict
    assert "after step 1: the final save found something wrong" in verdict.message, verdict
