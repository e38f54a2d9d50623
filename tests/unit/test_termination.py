"""The verdict a process leaves in its termination message, read back by the operator."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlft.trainer import termination
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.termination import Verdict


def test_each_rank_keeps_one_line_and_the_most_telling_verdict_wins(tmp_path):
    env = {termination.ENV: str(tmp_path / "termination-log")}
    termination.write(Verdict(ExitCode.FAILURE, "first attempt", rank=1), env)
    termination.write(Verdict(ExitCode.OK, rank=1), env)  # an in-pod restart replaces it
    termination.write(Verdict(ExitCode.OK, completed=True, step=7, last_checkpoint=6), env)
    text = (tmp_path / "termination-log").read_text()
    assert len(text.splitlines()) == 2 and "first attempt" not in text
    assert termination.read(text) == Verdict(0, completed=True, step=7, last_checkpoint=6)
    termination.write(Verdict(ExitCode.INVALID_CONFIG, "spec.data: bad", rank=1), env)
    verdict = termination.read((tmp_path / "termination-log").read_text())
    assert verdict.exit_code == ExitCode.INVALID_CONFIG and verdict.message == "spec.data: bad"
    # a rank that recovers removes its own line, and only its own
    termination.clear(1, env)
    text = (tmp_path / "termination-log").read_text()
    assert len(text.splitlines()) == 1 and "spec.data: bad" not in text
    assert termination.read(text) == Verdict(0, completed=True, step=7, last_checkpoint=6)


def test_a_late_verdict_never_replaces_the_processs_own(tmp_path, monkeypatch):
    """The verdict a timer writes for a rank SIGTERMed as it ended (`stopped while
    ending`) is written only when the rank wrote none: not over its own error."""
    monkeypatch.setattr(termination, "_written", False)
    env = {termination.ENV: str(tmp_path / "termination-log")}
    late = Verdict(ExitCode.FAILURE, "stopped while ending", rank=0)
    termination.write(Verdict(ExitCode.FAILURE, "DistBackendError: peer gone", rank=0), env)
    termination.write_unless_written(late, env)
    assert "peer gone" in termination.read((tmp_path / "termination-log").read_text()).message
    termination.clear(0, env)  # a stall's line, recovered from: none of its own any more
    termination.write_unless_written(late, env)
    assert termination.read((tmp_path / "termination-log").read_text()) == late


def test_among_equally_severe_lines_the_stalled_ranks_is_read(tmp_path):
    """Its peers' errors (a collective broken when it was killed) follow from it, and
    they may have written first."""
    env = {termination.ENV: str(tmp_path / "termination-log")}
    for rank in (1, 2):
        termination.write(Verdict(ExitCode.FAILURE, "collective broke", rank=rank), env)
    termination.write(Verdict(ExitCode.FAILURE, "no progress", rank=3, stalled=True), env)
    verdict = termination.read((tmp_path / "termination-log").read_text())
    assert verdict is not None and verdict.stalled and verdict.rank == 3


def test_a_worker_restarted_in_place_forgets_its_pods_earlier_generation(tmp_path, monkeypatch):
    """An elastic membership change: every worker wrote a `stopped` line (its emergency
    checkpoint) and torchrun started new ones in the same pod. When those died without
    a word (an NCCL abort), the old lines were read as their verdict (stopped: no
    failure) and the gang was never restarted."""
    env = {termination.ENV: str(tmp_path / "termination-log")}
    monkeypatch.setattr(termination, "STARTED", 1000.0)
    for rank in (0, 1):
        termination.write(Verdict(ExitCode.OK, "stopped", rank=rank, stopped=True), env)
    monkeypatch.setattr(termination, "STARTED", 1000.0 + 120)  # the next generation
    termination.forget_earlier_generations(env)
    assert termination.read((tmp_path / "termination-log").read_text()) is None
    # a worker of this generation that wrote already (it failed fast) is kept
    termination.write(Verdict(ExitCode.INVALID_CONFIG, "spec.data: bad", rank=1), env)
    monkeypatch.setattr(termination, "STARTED", 1000.0 + 121)
    termination.forget_earlier_generations(env)
    verdict = termination.read((tmp_path / "termination-log").read_text())
    assert verdict is not None and verdict.exit_code == ExitCode.INVALID_CONFIG


def test_the_process_group_waits_past_what_rank_0_may_do_alone():
    """The other ranks wait in a collective while rank 0 reaches the rollout pods or
    publishes the outputs through a store outage: the 600 s timeout ended a finished job
    as a failure (its final publication cut) and restarted it, again and again."""
    from pathlib import Path

    from rlft.trainer.cli.training import collective_timeout_s
    from rlft.trainer.config import load_job
    from rlft.trainer.rollout.session import pods_start_within

    examples = Path(__file__).parents[2] / "examples"
    for path in sorted(examples.glob("*.yaml")):
        job = load_job(path)
        timeout = collective_timeout_s(job)
        assert timeout > pods_start_within(job), path.name
        assert timeout > job.spec.checkpoint.upload_retry_minutes * 60, path.name
        assert timeout > job.spec.trainer.stall_timeout_seconds, path.name


def test_log_text_and_damaged_lines_are_no_verdict():
    assert termination.read("Traceback...\nRuntimeError: boom\n") is None
    assert termination.read('{"rlftVerdict": 1, "exit_code": "x"}\n{"rlftVerdict": 1') is None
    assert termination.read("") is None
    # JSON that is not a verdict line, though it names the mark
    assert termination.read('{"message": "rlftVerdict", "exit_code": 3}\n') is None
    assert termination.read('{"rlftVerdict": 0, "exit_code": 3}\n') is None
    # a number that is not an integer is no step (JSON true is not step 1)
    line = '{"rlftVerdict": 1, "exit_code": 0, "step": true, "last_checkpoint": 4.5}\n'
    assert termination.read(line) == Verdict(0)


def test_messages_are_capped_and_nothing_is_written_without_the_variable(tmp_path):
    line = termination.encode(Verdict(1, "x" * 10_000))
    assert len(line) < 1000 and termination.read(line).message == "x" * termination.MAX_MESSAGE
    termination.write(Verdict(1, "lost"), {})
    assert list(tmp_path.iterdir()) == []


def test_eight_ranks_with_long_messages_fit_what_the_kubelet_keeps(tmp_path):
    """The kubelet keeps a termination message's last 4096 bytes. Eight ranks' lines with
    600-character messages (non-ASCII ones escape to six bytes a character) used to
    exceed it, and the tail cut dropped the first-written verdicts: here the stalled
    rank's, the cause of its peers' errors, and with it the operator's Stalled reason."""
    path = tmp_path / "termination-log"
    env = {termination.ENV: str(path)}
    termination.write(Verdict(ExitCode.FAILURE, "no progress for 600 s", stalled=True), env)
    for rank in range(1, 8):
        message = f"rank {rank}: collective broke: " + "é" * 600
        termination.write(Verdict(ExitCode.FAILURE, message, rank=rank, step=40), env)
    data = path.read_bytes()
    assert len(data) <= termination.MAX_BYTES
    kept = data[-termination.MAX_BYTES :].decode()  # what a pod's status would carry
    assert len(kept.splitlines()) == 8
    verdict = termination.read(kept)
    assert verdict is not None and verdict.stalled and verdict.rank == 0
    assert verdict.message.startswith("no progress")
    lines = [json.loads(line) for line in kept.splitlines()]
    assert sorted(v["rank"] for v in lines) == list(range(8))
    assert all(v["step"] == 40 for v in lines if v["rank"])  # the numbers are never cut


@pytest.mark.parametrize(
    ("agent", "verdict", "code"),
    [
        (0, None, ExitCode.OK),
        (1, None, ExitCode.FAILURE),  # killed before writing anything
        (1, termination.Verdict(ExitCode.INVALID_CONFIG, "bad job", 0), ExitCode.INVALID_CONFIG),
        (1, termination.Verdict(ExitCode.COLLAPSED, "collapse", 1), ExitCode.COLLAPSED),
        (1, termination.Verdict(ExitCode.OK, "stopped", 0, stopped=True), ExitCode.OK),
        # One rank finished while another died without a word: a failure.
        (1, termination.Verdict(ExitCode.OK, "done", 0, completed=True), ExitCode.FAILURE),
    ],
)
def test_nproc_runs_exit_as_their_ranks_did(agent, verdict, code):
    from rlft.trainer.cli.training import ranks_exit_code

    assert ranks_exit_code(agent, verdict) == code


@pytest.mark.parametrize("stalled_writes", ["first", "last"])
def test_sixteen_ranks_in_a_pod_still_fit_and_keep_the_telling_line(tmp_path, stalled_writes):
    """16 ranks with a long checkpoint URI wrote more than 4096 bytes even with every
    message emptied; the kubelet kept the tail and cut the stalled rank's line, which
    made a Stalled failure an Error. The line kept is the telling one wherever it was
    written (the least telling lines go, not the newest)."""
    env = {termination.ENV: str(tmp_path / "termination-log")}
    uri = "s3://a-rather-long-bucket-name-for-checkpoints/team/project/runs/qwen3-moe"
    stalled = Verdict(
        ExitCode.FAILURE, "stalled in all_reduce", 2, stalled=True, step=41, last_checkpoint=40
    )
    stalled = dataclasses.replace(stalled, checkpoint_uri=uri)  # as long as its peers' lines
    if stalled_writes == "first":
        termination.write(stalled, env)
    for rank in (r for r in range(16) if r != 2):
        stopped = Verdict(ExitCode.OK, "x" * 300, rank=rank, stopped=True, step=41)
        termination.write(dataclasses.replace(stopped, last_checkpoint=40, checkpoint_uri=uri), env)
    if stalled_writes == "last":
        termination.write(stalled, env)
    text = (tmp_path / "termination-log").read_text()
    assert len(text.encode()) <= termination.MAX_BYTES
    verdict = termination.read(text)
    assert verdict is not None and verdict.stalled and verdict.rank == 2
