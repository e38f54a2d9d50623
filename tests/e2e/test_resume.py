"""Killing a local run and resuming it loses nothing: SIGKILL at a random step after a
checkpoint, then `rlft train` again, gives the metrics and final parameters of the
uninterrupted run bit for bit (same world size), and within float tolerance when the
resume runs on 2 ranks. SIGTERM writes an emergency checkpoint and exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from checkpoint_fixtures import s3_options
from processes import descendants_running, kill_tree, private_tmp
from prometheus_fixtures import free_port
from s3_proxy import S3Proxy
from safetensors.torch import load_file
from tiny_jobs import arithmetic_rl_spec, write_parity_job
from trainer_holds import WAIT_FOR_ROLLOUTS, Hold

from rlft.trainer import termination
from rlft.trainer.checkpoint.manifest import LATEST, MANIFEST, step_dir
from rlft.trainer.storage.backends import Storage, open_storage


def _timing(key: str) -> bool:
    """Wall-clock measurements, which no two runs share."""
    return key.endswith(("_s", "_per_s", "idle_ratio"))


STEPS = 8


def write_job(folder: Path, algorithm: dict) -> Path:
    spec = arithmetic_rl_spec(algorithm, STEPS, checkpoint={"intervalSteps": 2, "keepLast": 2})
    return write_parity_job(folder, spec, "resume")


def start(
    folder: Path,
    out: str,
    *extra: str,
    env: dict[str, str] | None = None,
    start_new_session: bool = False,
) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(folder), OMP_NUM_THREADS="1", **(env or {}))
    # What a pod's container reports when it ends (the operator reads it).
    env[termination.ENV] = str(folder / f"{out}.termination")
    return subprocess.Popen(
        [sys.executable, "-m", "rlft.trainer.cli.main", "train", "job.yaml", "--out", out, *extra],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=start_new_session,
    )


def records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not _timing(k)} for line in lines]


def wait_for_step(
    out: Path, step: int, process: subprocess.Popen, checkpoints: Storage | None = None
) -> None:
    """Until `step` is in metrics.jsonl and, with `checkpoints`, a checkpoint is committed
    there (checkpoints upload in the background: on a loaded machine the step-2 one can
    still be in flight at step 5, and a run killed then has nothing to resume from)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        reached = metrics.exists() and len(metrics.read_text().splitlines()) >= step
        if reached and (checkpoints is None or checkpoints.exists(LATEST)):
            return
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"step {step} never came")


def parameters(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "grpo", "groupSize": 4, "kl": {"coef": 0.1}},
        {"name": "ppo", "groupSize": 2},
    ],
    ids=["grpo-kl", "ppo"],
)
def test_sigkill_then_resume_is_bit_identical(tmp_path, algorithm) -> None:
    write_job(tmp_path, algorithm)
    whole = start(tmp_path, "whole")
    assert whole.wait(timeout=600) == 0, whole.stdout.read()

    kill_at = random.Random().randint(3, STEPS - 1)  # after the checkpoint of step 2
    victim = start(tmp_path, "killed")
    checkpoints = open_storage(str(tmp_path / "killed" / "checkpoints"))
    wait_for_step(tmp_path / "killed", kill_at, victim, checkpoints)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = start(tmp_path, "killed")
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output
    assert "resumed from the checkpoint of step" in output, output

    assert records(tmp_path / "killed") == records(tmp_path / "whole")
    final, expected = parameters(tmp_path / "killed"), parameters(tmp_path / "whole")
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name


def test_resume_on_two_ranks_continues_within_float_tolerance(tmp_path) -> None:
    write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    whole = start(tmp_path, "whole")
    assert whole.wait(timeout=600) == 0, whole.stdout.read()
    first = start(tmp_path, "split", "--max-steps", "6")
    assert first.wait(timeout=600) == 0, first.stdout.read()
    second = start(tmp_path, "split", "--nproc", "2")
    output = second.communicate(timeout=600)[0]
    assert second.returncode == 0, output
    assert "resumed from the checkpoint of step 6" in output
    for a, b in zip(records(tmp_path / "split"), records(tmp_path / "whole"), strict=True):
        assert a["reward_mean"] == b["reward_mean"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-7)
    final, expected = parameters(tmp_path / "split"), parameters(tmp_path / "whole")
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-4, atol=1e-6)


def checkpoint_rows(out: Path) -> list[list[str]]:
    """`rlft checkpoints list`'s rows (step, healthy, ranks, MB, created, notes such as
    latest and emergency), oldest first."""
    listing = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlft.trainer.cli.main",
            "checkpoints",
            "list",
            str(out / "checkpoints"),
        ],
        capture_output=True,
        text=True,
    )
    assert listing.returncode == 0, listing.stderr
    return [line.split() for line in listing.stdout.splitlines()[1:]]


def assert_last_checkpoint_is_an_emergency_one_of_the_last_step(out: Path) -> int:
    """`rlft checkpoints list`'s newest row: the last recorded step, committed, emergency;
    returns that step."""
    steps = len((out / "metrics.jsonl").read_text().splitlines())
    rows = checkpoint_rows(out)
    assert [str(steps), "yes"] == rows[-1][:2] and rows[-1][-1] == "emergency", rows
    return steps


def test_sigterm_writes_an_emergency_checkpoint_and_exits_0(tmp_path) -> None:
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = 400
    spec["spec"]["checkpoint"] = {"intervalSteps": 1000, "gracePeriodSeconds": 30}
    job.write_text(yaml.safe_dump(spec))
    process = start(tmp_path, "out")
    wait_for_step(tmp_path / "out", 3, process)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 0, output
    assert time.monotonic() - sent < 30
    assert "emergency checkpoint" in output
    step = assert_last_checkpoint_is_an_emergency_one_of_the_last_step(tmp_path / "out")
    # The termination message names it: the operator's sign that the job has a
    # checkpoint of its own even if it never polled /status after the commit.
    verdict = termination.read((tmp_path / "out.termination").read_text())
    assert verdict is not None and verdict.stopped and verdict.last_checkpoint == step


def test_a_resumed_run_reports_its_step_once_training_and_not_before(tmp_path) -> None:
    """/status says `starting` until the checkpoint is restored, then `training` at the
    resumed step and policy version: the operator mirrors step and version only then
    (it copied the 0s of every restarting trainer into the job's status)."""
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    first = start(tmp_path, "out", "--max-steps", "4")
    assert first.wait(timeout=600) == 0, first.stdout.read()
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = 400
    port = free_port()
    spec["spec"]["telemetry"] = {"port": port}
    job.write_text(yaml.safe_dump(spec))
    process = start(tmp_path, "out")
    seen: list[tuple[str, int, int]] = []
    try:
        deadline = time.monotonic() + 120
        while not seen or seen[-1][0] != "training":
            assert time.monotonic() < deadline and process.poll() is None, seen
            with contextlib.suppress(OSError):
                url = f"http://127.0.0.1:{port}/status"
                status = json.loads(urllib.request.urlopen(url, timeout=5).read())
                seen.append((status["phase"], status["step"], status["policyVersion"]))
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    assert {phase for phase, _, _ in seen[:-1]} <= {"starting"}, seen
    _, step, version = seen[-1]
    assert step >= 4 and version >= 4, seen  # the checkpoint's, or a step after it


def test_sigterm_in_the_warm_start_stops_at_once_and_exits_0(tmp_path) -> None:
    """The warm start is not checkpointed: SIGTERM there stops after the step in hand
    with exit 0 and a stopped verdict. It was ignored until the grace period ran out and
    the watchdog ended the rank with exit 1 and no verdict (counted a failure)."""
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["algorithm"]["sft"] = {"steps": 4000, "batchSize": 16}
    spec["spec"]["checkpoint"] = {"gracePeriodSeconds": 60}
    job.write_text(yaml.safe_dump(spec))
    # The reporter's line of every 200th warm-start step.
    output, took = _sigterm_once(start(tmp_path, "out"), "[200/4000]")
    assert took < 30, output
    assert "[4000/4000]" not in output
    _assert_stopped_before_the_first_step(tmp_path, output)


def _sigterm_once(process: subprocess.Popen, marker: str) -> tuple[str, float]:
    """SIGTERM once `marker` is in the output; (the whole output, seconds to the exit)."""
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in process.stdout], daemon=True)
    reader.start()
    seen = ""
    while marker not in seen:
        seen += lines.get(timeout=120)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)
    took = time.monotonic() - sent
    # The reader ends at the output's end (the pipe's EOF, once the process is gone):
    # then it has queued every line, however long a loaded machine took to read them.
    reader.join(timeout=30)
    output = seen + "".join(lines.get() for _ in range(lines.qsize()))
    assert process.returncode == 0, output
    return output, took


def _assert_stopped_before_the_first_step(folder: Path, output: str) -> None:
    assert "stopped before the first training step" in output, output
    verdict = termination.read((folder / "out.termination").read_text())
    assert verdict is not None and verdict.stopped and verdict.exit_code == 0


def test_failed_checkpoints_are_reported_as_failed(tmp_path, bucket, s3_env) -> None:
    """The object store refuses every checkpoint upload (a proxy in front of SeaweedFS
    answers them 503). A periodic checkpoint, given up once its retries run out, shows on
    the live run's /metrics (RLFTCheckpointFailing's gauge) and /status (it used to raise
    in the event handler and reach neither). Then SIGTERM: the emergency save is retried
    until the grace period runs out, and the run stops cleanly, saying its checkpoint
    failed and naming none in its termination message (it used to claim one)."""
    proxy = S3Proxy(s3_env.endpoint)
    process = None
    grace = 12  # at 6, 2 s between the retries giving up and the watchdog: flaky when loaded
    try:
        job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
        spec = yaml.safe_load(job.read_text())
        spec["spec"]["trainer"]["steps"] = 5000
        uri = f"s3://{bucket}/runs/refused"
        spec["spec"]["checkpoint"] = {
            "uri": uri,
            "endpointUrl": proxy.url,
            "addressingStyle": "path",
            "intervalSteps": 2,
            "uploadRetryMinutes": 0.05,
            "gracePeriodSeconds": grace,
        }
        port = free_port()
        spec["spec"]["telemetry"] = {"port": port}
        spec["spec"]["stability"] = {"onCollapse": "alert"}  # tiny runs trip it in ~30 steps
        job.write_text(yaml.safe_dump(spec))
        proxy.refuse("/step-")  # reads pass: the trainer's start-up check of the bucket
        process = start(tmp_path, "out")
        wait_for_step(tmp_path / "out", 2, process)
        failed = _wait_for_failed_checkpoint(f"http://127.0.0.1:{port}", process)
        assert "failed and was not committed" in failed["message"], failed
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        output = process.communicate(timeout=60)[0]
        stopped_after = time.monotonic() - sent
    finally:
        if process is not None and process.poll() is None:
            kill_tree(process)
        proxy.stop()
    # Exit 0 with a stopped verdict already says the grace was kept: the watchdog ends a
    # rank still at work when it runs out, with exit 1 and a failure verdict. This bound
    # is the exit's: it fails a process that went on well past its grace, not one that a
    # loaded machine made slow to exit.
    assert process.returncode == 0, output
    assert stopped_after < grace + 20, (stopped_after, output)
    assert "whose emergency checkpoint failed (the newest committed checkpoint: none)" in output
    assert "stopped after the emergency checkpoint" not in output, output
    assert "Traceback" not in output, output
    storage = open_storage(uri, s3_options(s3_env))
    assert not storage.exists(LATEST) and not storage.list("step-")  # nothing half-made
    verdict = termination.read((tmp_path / "out.termination").read_text())
    assert verdict is not None and verdict.stopped and verdict.last_checkpoint is None


def _wait_for_failed_checkpoint(url: str, process: subprocess.Popen) -> dict:
    """The checkpoint_failed event on /status, once /metrics counts a failed attempt."""
    counted = re.compile(r'^rlft_checkpoints_total\{[^}]*result="failed"[^}]*\} [1-9]', re.M)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
        if counted.search(metrics):
            assert re.search(r"^rlft_checkpoint_last_ok(\{[^}]*\})? 0\.0$", metrics, re.M)
            status = json.loads(urllib.request.urlopen(f"{url}/status", timeout=5).read())
            return next(e for e in status["events"] if e["kind"] == "checkpoint_failed")
        time.sleep(0.2)
    raise AssertionError("no failed checkpoint on /metrics")


def write_long_job(
    folder: Path, *, interval: int = 1000, grace: int = 60, rollout_server: bool = False
) -> None:
    """A GRPO job longer than any test waits for (400 steps), checkpointing every
    `interval` steps (by default never), with a grace of `grace` seconds; with
    `rollout_server`, sampling from one local rollout server instead of in process."""
    job = write_job(folder, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["trainer"]["steps"] = 400
    if rollout_server:
        spec["spec"]["rollout"] |= {"local": "servers", "instances": 1, "maxStaleness": 0}
    spec["spec"]["checkpoint"] = {"intervalSteps": interval, "gracePeriodSeconds": grace}
    # Collapse only alerts: these tests stop the run themselves, and a collapse with no
    # checkpoint to roll back to would end it first (exit 3), were the test slow to act.
    spec["spec"]["stability"] = {"onCollapse": "alert"}
    job.write_text(yaml.safe_dump(spec))


GRACE = 30
"""The grace period of the tests that stop a trainer waiting for rollouts."""


def test_sigterm_while_the_rollout_server_is_gone_still_checkpoints_and_exits_0(
    tmp_path,
) -> None:
    """A suspend deletes every pod of a job at once: the trainer's SIGTERM comes while it
    waits for a batch from a rollout server that will not answer (here: stopped with
    SIGSTOP). The trainer stops waiting, checkpoints the step it finished and exits 0,
    well inside its grace period, instead of being killed at its end with no checkpoint."""
    write_long_job(tmp_path, grace=GRACE, rollout_server=True)
    hold = Hold(tmp_path, WAIT_FOR_ROLLOUTS)
    process = start(tmp_path, "out")
    servers: list[int] = []
    try:
        wait_for_step(tmp_path / "out", 3, process)
        servers = descendants_running(process.pid, "rlft.trainer.rollout.server")
        assert len(servers) == 1, servers
        os.kill(servers[0], signal.SIGSTOP)
        # Until rank 0 waits for a batch (a step may take more than any sleep), and
        # then until the signal: a batch still in flight cannot end that wait first.
        hold.arm()
        hold.wait(process)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        checkpoints = tmp_path / "out" / "checkpoints"
        while not (checkpoints / LATEST).exists() and time.monotonic() - sent < GRACE + 10:
            assert process.poll() is None or process.returncode == 0, process.stdout.read()
            time.sleep(0.2)
        committed_after = time.monotonic() - sent
        os.kill(servers[0], signal.SIGCONT)  # let it see the trainer's SIGTERM and go
        output = process.communicate(timeout=60)[0]
    finally:
        if process.poll() is None:
            kill_tree(process)
        for pid in servers:  # a trainer that died at its grace left its server behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert process.returncode == 0, output
    # Killed at the grace's end, the trainer would have committed nothing.
    assert committed_after < GRACE, (committed_after, output)
    assert "stopping while waiting for rollouts; checkpointing step" in output, output
    assert_last_checkpoint_is_an_emergency_one_of_the_last_step(tmp_path / "out")


def test_sigterm_while_waiting_for_the_rollout_pods_to_start_exits_0_at_once(tmp_path) -> None:
    """A job deleted before its rollout pods ever answered (they never will): SIGTERM
    ends the trainer's wait for them at once, with exit 0 and a stopped verdict. It was
    ignored until the grace watchdog fired, which held the job's ports for its whole
    grace and ended the rank with exit 1."""
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["checkpoint"]["gracePeriodSeconds"] = 60
    spec["spec"]["rollout"]["weightsUri"] = (tmp_path / "weights").as_uri()
    job.write_text(yaml.safe_dump(spec))
    nobody = f"http://127.0.0.1:{free_port()}"  # the operator's rollout pods, never up
    process = start(tmp_path, "out", env={"RLFT_ROLLOUT_URLS": nobody})
    output, took = _sigterm_once(process, "waiting for rollout instance 0")
    assert took < 20, output  # the grace is 60 s
    assert "stopping while waiting for rollout instance 0" in output, output
    _assert_stopped_before_the_first_step(tmp_path, output)


def test_an_error_after_a_trained_step_is_a_failure_to_retry_not_a_bad_job(tmp_path) -> None:
    """A ValueError at step 5 (planted: a bug or a library's error on some batch) once
    steps have trained is not the job's configuration: exit 1 with its traceback and a
    verdict of 1, which the operator restarts, not exit 2, which fails the job for good
    with the message alone. The restart resumes from its checkpoint at step 4 and meets
    the error again in its own first step: still exit 1 (it was 2, judged by the process
    alone, so one restart turned a retryable failure into a permanent one). Run again
    without the fault, it completes. (Step 4's checkpoint, or step 2's: a save due while
    the one before still uploads is skipped, which a loaded machine makes happen.)"""
    write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    planted = json.dumps([{"kind": "error", "rank": 0, "at": 5}])
    latest = tmp_path / "out" / "checkpoints" / LATEST
    for attempt in range(2):
        before = latest.read_text().strip() if latest.exists() else None
        process = start(tmp_path, "out", env={"RLFT_PLANT_FAULTS": planted})
        output = process.communicate(timeout=300)[0]
        assert process.returncode == 1, (attempt, output)
        assert "Traceback" in output and "step 5 failed: planted fault" in output, output
        verdict = termination.read((tmp_path / "out.termination").read_text())
        assert verdict is not None and verdict.exit_code == 1 and "step 5" in verdict.message
        assert attempt == 0 or _resumed_from(before) in output, output
    before = latest.read_text().strip()
    assert before in (step_dir(2), step_dir(4)), before
    again = start(tmp_path, "out")
    output = again.communicate(timeout=300)[0]
    assert again.returncode == 0, output
    assert _resumed_from(before) in output and len(records(tmp_path / "out")) == STEPS, output


def _resumed_from(folder: str | None) -> str:
    """What a run says that resumed from the checkpoint `latest` named (`step-000004`)."""
    assert folder is not None, "no checkpoint committed before the restart"
    return f"rlft: resumed from the checkpoint of step {int(folder.removeprefix('step-'))}"


def test_sigkill_then_resume_from_s3(tmp_path, bucket, s3_env) -> None:
    """The same, with checkpoints in a real SeaweedFS S3 bucket, resumed in a new output
    folder (as a replaced pod is): the checkpoint carries metrics.jsonl's history, so the
    resumed run's file has every step once, with the prompts of the uninterrupted run."""
    job = write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["checkpoint"] |= {
        "uri": f"s3://{bucket}/runs/resume",
        "endpointUrl": s3_env.endpoint,
        "addressingStyle": "path",
    }
    job.write_text(yaml.safe_dump(spec))
    whole = start(tmp_path, "whole", "--resume", "never")
    assert whole.wait(timeout=600) == 0, whole.stdout.read()
    # `whole` left its checkpoints in the bucket: a fresh prefix for the killed run.
    spec["spec"]["checkpoint"]["uri"] = f"s3://{bucket}/runs/killed"
    job.write_text(yaml.safe_dump(spec))
    victim = start(tmp_path, "killed")
    storage = open_storage(f"s3://{bucket}/runs/killed", s3_options(s3_env))
    wait_for_step(tmp_path / "killed", 5, victim, storage)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = start(tmp_path, "new-pod")
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output
    assert f"s3://{bucket}/runs/killed" in output and "resumed from the checkpoint" in output
    history = records(tmp_path / "new-pod")
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    assert len({r["data_digest"] for r in history}) == STEPS  # each step its own prompts
    assert history == records(tmp_path / "whole")
    final, expected = parameters(tmp_path / "new-pod"), parameters(tmp_path / "whole")
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def _agent(folder: Path, out: str, resume: str, port: int) -> subprocess.Popen:
    """One trainer pod's elastic agent, as the operator writes it: c10d rendezvous with
    a peer, one worker running `rlft train` as a rank, its own --out and --resume."""
    env = dict(
        os.environ,
        PYTHONPATH=str(folder),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        TMPDIR=str(private_tmp(folder / f"{out}-tmp")),  # a pod's own /tmp (torchelastic_*)
    )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=gang"),
        *("-m", "rlft.trainer.cli.main", "train", "job.yaml", "--out", out, f"--resume={resume}"),
    ]
    return subprocess.Popen(
        command,
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the agent and its worker, stopped together by the test
    )


def test_a_gang_started_with_different_resume_arguments_loads_one_checkpoint(tmp_path):
    """A replaced trainer pod may start with --resume=4 (say) while the survivor restarts
    with auto (→ step 6): rank 0's choice counts for both, so the run equals one that
    resumed from that checkpoint on every rank (ranks that chose differently would
    deadlock in the load's collectives, or train a model made of two checkpoints).
    The explicit step is the newest committed one but the latest: a save due at step 4
    waits while step 2's is still being written, so on a loaded machine the first run
    may keep 2, 5, 6 instead of 2, 4, 6."""
    spec = arithmetic_rl_spec(
        {"name": "grpo", "groupSize": 4},
        STEPS,
        checkpoint={"uri": (tmp_path / "shared").as_uri(), "intervalSteps": 2, "keepLast": 3},
    )
    write_parity_job(tmp_path, spec, "gang")
    first = start(tmp_path, "first", "--max-steps", "6")
    assert first.wait(timeout=600) == 0, first.stdout.read()
    shutil.copytree(tmp_path / "shared", tmp_path / "shared-copy")
    committed = sorted(
        int(m.parent.name[5:]) for m in (tmp_path / "shared").glob(f"step-*/{MANIFEST}")
    )
    assert len(committed) >= 2 and committed[-1] == 6, committed
    explicit, latest = committed[-2], committed[-1]

    port = free_port()
    gang = [
        _agent(tmp_path, "pod-a", str(explicit), port),
        _agent(tmp_path, "pod-b", "auto", port),
    ]
    try:
        # Ranks that chose different checkpoints deadlock in the load's collectives.
        outputs = [agent.communicate(timeout=240)[0] for agent in gang]
    finally:
        for agent in gang:  # the agents and their workers (in sessions of their own)
            if agent.poll() is None:
                kill_tree(agent)
    assert [agent.returncode for agent in gang] == [0, 0], "\n".join(outputs)
    main = 0 if (tmp_path / "pod-a" / "model").exists() else 1
    chosen = explicit if main == 0 else latest
    assert f"resumed from the checkpoint of step {chosen}" in outputs[main], outputs[main]

    # The same resume on both ranks, from the untouched copy of the checkpoints.
    shutil.rmtree(tmp_path / "shared")
    shutil.copytree(tmp_path / "shared-copy", tmp_path / "shared")
    same = start(tmp_path, "same", "--nproc", "2", f"--resume={chosen}")
    assert same.wait(timeout=600) == 0, same.stdout.read()
    final = parameters(tmp_path / ("pod-a" if main == 0 else "pod-b"))
    expected = parameters(tmp_path / "same")
    for name in expected:
        assert torch.equal(final[name], expected[name]), name


def test_a_run_whose_checkpoints_are_all_damaged_fails_instead_of_starting_afresh(
    tmp_path,
) -> None:
    """Exit 1 (retryable: the objects may come back) with the damaged folders named; a
    fresh start would commit step 2, move `latest` back and abandon the steps they hold."""
    write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    first = start(tmp_path, "out", "--max-steps", "4")
    assert first.wait(timeout=600) == 0, first.stdout.read()
    checkpoints = open_storage(str(tmp_path / "out" / "checkpoints"))
    committed = sorted(info.key for info in checkpoints.list("") if info.key.endswith(MANIFEST))
    assert committed == ["step-000002/manifest.json", "step-000004/manifest.json"]
    for folder in ("step-000002", "step-000004"):
        shard = f"{folder}/__0_0.distcp"
        checkpoints.put_bytes(shard, checkpoints.get_bytes(shard)[:-8])
    before = {info.key: info.size for info in checkpoints.list("")}
    latest = checkpoints.get_bytes(LATEST)
    history = records(tmp_path / "out")

    # As run by hand, and as the operator restarts a failed gang (which, finding no
    # intact healthy checkpoint, looks for any intact one before it gives up).
    for which in ("auto", "latest-healthy"):
        again = start(tmp_path, "out", "--resume", which)
        output = again.communicate(timeout=600)[0]
        assert again.returncode == 1, output
        assert "no usable checkpoint for --resume=auto" in output, output
        assert ("no intact healthy checkpoint" in output) == (which == "latest-healthy")
        assert "step-000002: __0_0.distcp" in output and "step-000004: __0_0.distcp" in output
        assert records(tmp_path / "out") == history  # no step was trained
        assert {info.key: info.size for info in checkpoints.list("")} == before
        assert checkpoints.get_bytes(LATEST) == latest


def test_latest_healthy_without_any_checkpoint_starts_the_job_again(tmp_path) -> None:
    """The operator restarts every failed gang with --resume=latest-healthy; a failure
    before the first checkpoint must not turn into 'no checkpoint' (exit 2) forever."""
    write_job(tmp_path, {"name": "grpo", "groupSize": 4})
    attempt = start(tmp_path, "attempt", "--resume", "never")
    wait_for_file = time.monotonic() + 120
    while not (tmp_path / "attempt" / "job.yaml").exists():  # killed in the warm start
        assert time.monotonic() < wait_for_file and attempt.poll() is None
        time.sleep(0.05)
    attempt.kill()
    attempt.wait()
    assert not (tmp_path / "attempt" / "checkpoints").exists() or not any(
        (tmp_path / "attempt" / "checkpoints").rglob("manifest.json")
    )
    again = start(tmp_path, "attempt", "--resume", "latest-healthy")
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 0, output
    assert "no checkpoint at all; starting from the beginning" in output
    assert [r["step"] for r in records(tmp_path / "attempt")] == list(range(1, STEPS + 1))
    # A step the user names is still required to exist.
    named = start(tmp_path, "attempt", "--resume", "99")
    output = named.communicate(timeout=600)[0]
    assert named.returncode == 2 and "99" in output, output


def test_a_checkpoint_saved_before_the_first_rl_update_resumes(tmp_path, monkeypatch) -> None:
    """The warm start's last gradients stayed on the parameters when RL's fresh optimizer
    came: a checkpoint saved before RL's first update (here its first step trains no
    token: every 1-token completion is cut off and overlong filtering masks it) held an
    optimizer without its moments, and the resume failed for good (exit 2, "another
    model's checkpoint")."""
    from rlft.trainer.cli.main import main

    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4, "overlong": {"filter": True}})
    spec["rollout"] = {"sampling": {"maxNewTokens": 1}}
    spec["checkpoint"] = {"intervalSteps": 1}
    write_parity_job(tmp_path, spec)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "job.yaml", "--out", "out", "--max-steps", "1"]) == 0
    first = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["update_applied"] is False, first  # the premise: no update at step 1
    assert main(["train", "job.yaml", "--out", "out", "--max-steps", "2"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert steps == [1, 2]
    sys.modules.pop("parity_reward", None)
