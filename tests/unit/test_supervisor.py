"""The supervisor's bookkeeping around the guard: decisions shared as plain data, and
checkpoint retries counted as a metric and reported as a /status event and log line."""

from __future__ import annotations

import math
import time

import pytest
from tiny_jobs import TINY_MODEL, manifest

from rlft.trainer.config import parse_job
from rlft.trainer.distributed import Dist
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.run.supervisor import RunEnded, Supervisor


def supervisor(logged: list[str]) -> Supervisor:
    job = parse_job(manifest({"model": TINY_MODEL, "telemetry": {"enabled": False}}))
    return Supervisor(job, Dist(), logged.append)


def test_checkpoint_retries_are_a_metric_an_event_and_a_log_line() -> None:
    logged: list[str] = []
    sup = supervisor(logged)
    sup.checkpoint_retry("checkpoint of step 20: upload retried (connection refused)", 20)
    sup.checkpoint_retry("checkpoint of step 20: upload retried (connection refused)", 20)
    text = sup.telemetry.exporter.exposition().decode()
    assert "rlft_checkpoint_upload_retries_total 2.0" in text
    events = [
        e for e in sup.telemetry.board.snapshot()["events"] if e["kind"] == "checkpoint_retry"
    ]
    assert len(events) == 2 and events[0]["step"] == 20
    assert any("upload retried" in line for line in logged)
    # other ranks' retries, gathered by rank 0's saver, count as many
    sup.checkpoint_retry("checkpoint of step 20: other ranks retried storage calls", 20, 3)
    text = sup.telemetry.exporter.exposition().decode()
    assert "rlft_checkpoint_upload_retries_total 5.0" in text


def test_a_spike_is_judged_skip_and_ends_nothing() -> None:
    sup = supervisor([])
    for step in range(1, 30):
        record = {"step": step, "grad_norm": 1.0 + 0.01 * (step % 3), "loss": 0.1}
        assert sup.judge(record).action == "apply"
    decision = sup.judge({"step": 30, "grad_norm": 500.0, "loss": 0.1})
    assert decision.action == "skip"
    assert sup.ended(decision, 30) is None
    assert sup.judge({"step": 31, "grad_norm": math.nan, "loss": 0.1}).action == "skip"
    assert sup.state_dict()["skipped"] == 2


def test_the_main_phase_exports_the_step_it_resumed_from_at_once() -> None:
    """A resumed run stuck in its first step: the step gauge said 0 (what RLFTNoProgress
    reads as a warm start, so it never fired) until a step finished."""
    sup = supervisor([])
    sup.begin(False, 0, 0)  # the warm start
    text = sup.telemetry.exporter.exposition().decode()
    assert "rlft_train_step 0.0" in text
    assert "rlft_main_phase_start_time_seconds 0.0" in text
    before = time.time()
    sup.begin(True, 500, 510)
    text = sup.telemetry.exporter.exposition().decode()
    assert "rlft_train_step 500.0" in text and "rlft_policy_version 510.0" in text
    # ...and when it began: a fresh run stuck at step 0 is told from one in its warm start
    (began,) = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("rlft_main_phase_start_time_seconds ")
    ]
    assert before <= began <= time.time()
    assert sup.telemetry.board.snapshot()["phase"] == "training"


def test_rollout_engines_are_counted_at_each_scrape_not_only_when_a_step_ends() -> None:
    """Every engine dead: no step ends (the trainer waits for rollouts), and the gauges
    kept the last step's count, so RLFTRolloutEnginesDown could not fire."""
    from rlft.trainer.rollout.client import RolloutClient

    sup = supervisor([])
    client = RolloutClient(["http://127.0.0.1:9", "http://127.0.0.1:10"], 1.0)
    try:
        sup.watch_engines(client)
        sup.record({"step": 3, "rollout_engines_healthy": 2.0, "rollout_engines_expected": 2.0})
        text = sup.telemetry.exporter.exposition().decode()
        assert "rlft_rollout_engines_healthy 2.0" in text
        for instance in client.instances:
            client.mark_down(instance, "connection refused")
        text = sup.telemetry.exporter.exposition().decode()
        assert "rlft_rollout_engines_healthy 0.0" in text
        assert "rlft_rollout_engines_expected 2.0" in text
    finally:
        client.close()


@pytest.mark.parametrize(
    ("on_collapse", "code", "words"),
    [("fail", ExitCode.COLLAPSED, "failing"), ("suspend", ExitCode.OK, "paused")],
)
def test_a_collapse_ends_the_run_as_the_job_asked(on_collapse, code, words) -> None:
    """Three skipped spikes in the window are a collapse: `fail` ends the run as
    collapsed, `suspend` pauses it (exit 0: a resume goes on from a healthy checkpoint)."""
    job = parse_job(
        manifest(
            {
                "model": TINY_MODEL,
                "telemetry": {"enabled": False},
                "stability": {"onCollapse": on_collapse},
            }
        )
    )
    sup = Supervisor(job, Dist(), [].append)
    for step in range(1, 30):
        assert sup.judge({"step": step, "grad_norm": 1.0 + 0.01 * (step % 3)}).action == "apply"
    decisions = [sup.judge({"step": step, "grad_norm": 500.0}) for step in (30, 32, 34)]
    assert [d.action for d in decisions[:2]] == ["skip", "skip"]
    assert [sup.ended(d, d.step) for d in decisions[:2]] == [None, None]
    ended = sup.ended(decisions[2], 34)
    assert isinstance(ended, RunEnded) and ended.code == code
    assert "collapse at step 34" in str(ended) and words in str(ended)
