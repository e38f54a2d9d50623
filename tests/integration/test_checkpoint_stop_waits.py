"""A SIGTERM while the run waits for a save that is still retrying a store outage (before
a rollback loads, before the final save): the save gives up within the grace period left,
not after its own uploadRetryMinutes, and the run goes on to stop with a verdict. A real
run's checkpoint handling on a SeaweedFS bucket, behind a proxy that answers its uploads
503 as a store down for writes does; the signal's flag set as the handler sets it (a
real SIGTERM would arm the grace watchdog inside the test process)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from tiny_jobs import TINY_MODEL, manifest

from rlft.trainer.config import parse_job
from rlft.trainer.distributed import Dist
from rlft.trainer.learner.learner import Learner
from rlft.trainer.run.checkpointing import Checkpointing
from rlft.trainer.run.parts import build_parts
from rlft.trainer.run.state import Cursor
from rlft.trainer.run.supervisor import Supervisor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
GRACE_S = 5.0
RETRY_MINUTES = 1.0


@pytest.fixture
def run(tmp_path: Path, bucket, store_proxy, one_torch_thread):
    """A run with step 10 committed and step 20's save in flight, retrying uploads the
    store refuses: (checkpoints, learner, cursor, log lines)."""
    job = parse_job(
        manifest(
            {
                "model": TINY_MODEL,
                "telemetry": {"enabled": False},
                "checkpoint": {
                    "uri": f"s3://{bucket}/ckpts",
                    "endpointUrl": store_proxy.url,
                    "addressingStyle": "path",
                    "intervalSteps": 10,
                    "gracePeriodSeconds": GRACE_S,
                    "uploadRetryMinutes": RETRY_MINUTES,
                },
            }
        )
    )
    parts = build_parts(job)
    dist = Dist()
    learner = Learner(parts.policy, job.spec.trainer, dist)
    lines: list[str] = []
    supervisor = Supervisor(job, dist, lines.append)
    (tmp_path / "out").mkdir()
    checkpoints = Checkpointing(
        job, tmp_path / "out", dist, learner.engine_model, parts.tokenizer, supervisor
    )
    try:
        cursor = Cursor(job.spec.trainer.seed)
        cursor.step = cursor.policy_version = 10
        checkpoints.end_of_step(cursor, learner)
        checkpoints.checkpointer.wait()
        assert checkpoints.last_step == 10
        store_proxy.refuse("/ckpts/")  # uploads: 503 at once; reads pass
        cursor.step = cursor.policy_version = 20
        checkpoints.end_of_step(cursor, learner)  # in flight, retrying
        assert checkpoints.checkpointer.busy
        yield checkpoints, learner, cursor, lines
    finally:
        checkpoints.close()
        supervisor.close()


def _sigterm_soon(checkpoints: Checkpointing) -> None:
    def signal_arrives() -> None:
        time.sleep(0.5)
        checkpoints.stop.received_at = time.monotonic()
        checkpoints.stop.requested = True

    threading.Thread(target=signal_arrives, daemon=True).start()


def test_a_sigterm_while_the_final_save_waits_for_a_retrying_one(run) -> None:
    checkpoints, learner, cursor, lines = run
    cursor.step = 23
    _sigterm_soon(checkpoints)
    started = time.monotonic()
    checkpoints.final(cursor, learner)
    # Before: it waited out the retrying save's 60 s, far past the grace period.
    assert time.monotonic() - started < GRACE_S
    assert checkpoints.stats.failed == 2  # step 20's, then the final one's
    assert any("the final checkpoint of step 23 failed" in line for line in lines)
    assert checkpoints.last_step == 10


def test_a_sigterm_while_a_rollback_waits_for_a_retrying_save(run) -> None:
    checkpoints, learner, cursor, lines = run
    cursor.step = 23
    _sigterm_soon(checkpoints)
    started = time.monotonic()
    assert checkpoints.rollback(21, cursor, learner, replay_data=False) == 10
    # Before: it waited out the retrying save's 60 s, then the pointer's move as long.
    assert time.monotonic() - started < GRACE_S
    assert checkpoints.stats.failed == 1
    assert any("could not point" in line and "restored step 10" in line for line in lines)
