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

import pytest
from processes import kill_tree
from test_resume import start, write_job

from rlft.trainer import termination

ENDS_WITHIN_S = 90
"""Far past a run of two steps here, far below the group's 600 s timeout."""


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_failing_on_one_rank_ends_the_run_at_once_with_its_verdict(tmp_path, rank):
    write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    planted = json.dumps([{"kind": "error", "rank": rank, "at": 2}])
    process = start(tmp_path, "out", "--nproc", "2", env={"RLFT_PLANT_FAULTS": planted})
    started = time.monotonic()
    try:
        output = process.communicate(timeout=ENDS_WITHIN_S)[0]
    except subprocess.TimeoutExpired:
        kill_tree(process)
        output = process.communicate()[0]
        raise AssertionError(
            f"still running {time.monotonic() - started:.0f} s after rank {rank} failed:\n"
            + output[-3000:]
        ) from None
    assert process.returncode == 1, output
    assert f"step 2 failed: planted fault: rank {rank} fails at step 2" in output, output
    verdict = termination.read((tmp_path / "out.termination").read_text())
    assert verdict is not None and verdict.exit_code == 1, verdict
    assert f"rank {rank} fails at step 2" in verdict.message, verdict
