"""The collapse guard inside real local runs: a planted gradient spike is skipped before
the optimizer step while a real Prometheus, scraping the run's /metrics, fires the
RLFTGradientSpike alert; a planted persistent blow-up is rolled back to the last healthy
checkpoint and the run still finishes, also with rollout servers running ahead (which
then regenerate from the restored weights)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prometheus_fixtures import prometheus  # noqa: F401 (fixture)
from tiny_jobs import TINY_MODEL, manifest

from rlft.trainer.telemetry.generate import RULES

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_job(folder: Path, steps: int, **spec: dict) -> Path:
    # A smooth reward (mean byte value of the completion): steady statistics, real gradients.
    (folder / "byte_reward.py").write_text(
        "def mean_byte(completion, answer):\n"
        "    data = completion.encode()\n"
        "    return sum(data) / (255 * len(data)) if data else 0.0\n"
    )
    job = manifest(
        {
            "model": TINY_MODEL,
            "data": {"arithmetic": {"digits": 2, "evalSize": 40}},
            "reward": {"functions": [{"name": "byte_reward:mean_byte"}]},
            "algorithm": {"sft": {"steps": 3, "batchSize": 8, "warmupSteps": 1}, "groupSize": 4},
            "trainer": {
                "steps": steps,
                "promptsPerStep": 8,
                "microBatchSize": 32,
                "learningRate": 0.0003,
            },
            "rollout": {"sampling": {"maxNewTokens": 4}},
            "eval": {"maxProblems": 20},
        }
        | spec,
        "drill",
    )
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def start(folder: Path, faults: list[dict], *args: str, **env: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=str(folder),
        OMP_NUM_THREADS="1",
        RLFT_PLANT_FAULTS=json.dumps(faults),
        **env,
    )
    return subprocess.Popen(
        [sys.executable, "-m", "rlft.trainer.cli.main", "train", "job.yaml", "--out", "out", *args],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def records(folder: Path) -> dict[int, dict]:
    lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def firing(alerts: list[dict], name: str) -> bool:
    return any(a["labels"]["alertname"] == name and a["state"] == "firing" for a in alerts)


def test_planted_spike_is_skipped_and_prometheus_fires(tmp_path, prometheus) -> None:  # noqa: F811
    port = free_port()
    write_job(tmp_path, 5000, telemetry={"port": port})
    server = prometheus([f"127.0.0.1:{port}"], [REPO / RULES])
    spike = 150  # late enough for Prometheus to have scraped the healthy counters
    run = start(tmp_path, [{"kind": "grad_scale", "from": spike, "to": spike + 1, "factor": 100}])
    try:
        deadline = time.monotonic() + 180
        while not firing(server.alerts(), "RLFTGradientSpike"):
            assert run.poll() is None, "the run ended before the alert fired: " + run.stdout.read()
            assert time.monotonic() < deadline, "RLFTGradientSpike never fired"
            time.sleep(0.5)
        skipped = server.query("rlft_skipped_updates_total")
        assert [float(r["value"][1]) for r in skipped] == [1.0]
    finally:
        run.send_signal(signal.SIGTERM)  # enough: checkpoint and stop
        output = run.communicate(timeout=120)[0]
    assert run.returncode == 0, output
    by_step = records(tmp_path)
    assert by_step[spike]["guard_action"] == "skip"
    assert by_step[spike]["update_applied"] is False
    assert by_step[spike]["grad_norm"] > 20 * by_step[spike - 1]["grad_norm"]
    assert [s for s, r in by_step.items() if r["guard_action"] != "apply"] == [spike]
    # The skipped update was never applied: the policy version did not advance.
    assert by_step[spike + 1]["policy_version"] == by_step[spike - 1]["policy_version"] + 1


@pytest.mark.parametrize("skip_window", [True, False], ids=["skip-window", "replay-window"])
def test_persistent_blowup_is_rolled_back_and_the_run_finishes(tmp_path, skip_window) -> None:
    stability = {"skipDataWindow": skip_window}
    write_job(tmp_path, 70, checkpoint={"intervalSteps": 5, "keepLast": 20}, stability=stability)
    run = start(tmp_path, [{"kind": "grad_scale", "from": 40, "to": 46, "factor": 100}])
    output = run.communicate(timeout=600)[0]
    assert run.returncode == 0, output
    by_step = records(tmp_path)
    actions = {s: r["guard_action"] for s, r in by_step.items() if r["guard_action"] != "apply"}
    assert "rollback" in actions.values(), actions
    assert set(actions) <= set(range(40, 46)), actions  # only the planted steps
    # To the newest healthy checkpoint before the blow-up: step 35's, or on a loaded
    # machine a later step's below 40, when the save due at 35 waited for step 30's upload
    # (`poll` defers a due save while one is in flight), or step 30's if it waited past 40.
    restored = re.search(r"rolled back to the healthy checkpoint of step (\d+)", output)
    assert restored and 30 <= int(restored[1]) < 40, output[-3000:]
    rollback = min(s for s, a in actions.items() if a == "rollback")
    # The restored policy is published as a new version: versions only grow.
    versions = [by_step[s]["policy_version"] for s in sorted(by_step)]
    assert versions == sorted(versions)
    assert by_step[rollback + 1]["lr"] < by_step[rollback - 1]["lr"]  # scaled down
    # Saved at once (it waited for the next step due: a crash meanwhile undid it).
    assert rollback % 5, rollback  # else the schedule saves it anyway
    extra = tmp_path / "out" / "checkpoints" / f"step-{rollback:06d}" / "extra.json"
    assert json.loads(extra.read_text())["guard"]["rollbacks"] == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 70
    # The step after the rollback trains on what came after the restored checkpoint
    # again (skipDataWindow: false), or on what comes after the bad window (true: the
    # option did nothing, the window was always skipped).
    again = by_step[rollback + 1]["data_digest"] == by_step[int(restored[1]) + 1]["data_digest"]
    assert again is not skip_window


def test_rollback_with_rollout_servers_regenerates_from_the_restored_weights(tmp_path) -> None:
    rollout = {"sampling": {"maxNewTokens": 4}, "local": "servers", "maxStaleness": 1}
    write_job(tmp_path, 60, checkpoint={"intervalSteps": 5}, rollout=rollout)
    run = start(tmp_path, [{"kind": "grad_scale", "from": 40, "to": 46, "factor": 100}])
    output = run.communicate(timeout=600)[0]
    assert run.returncode == 0, output
    by_step = records(tmp_path)
    assert sorted(by_step) == list(range(1, 61))
    rollback = min(s for s, r in by_step.items() if r["guard_action"] == "rollback")
    versions = [by_step[s]["policy_version"] for s in sorted(by_step)]
    assert versions == sorted(versions)
    assert max(r["staleness_max"] for r in by_step.values()) == 1  # the servers ran ahead
    assert all(r["staleness_max"] <= 1 for r in by_step.values())
    # What the servers had generated, or had in flight, with the abandoned weights is
    # dropped: the next batch comes from the restored weights alone (staleness 0; a
    # sample of the abandoned policy would be 1 version old).
    assert by_step[rollback + 1]["staleness_max"] == 0
    assert by_step[rollback + 1]["stale_dropped"] == 0


def test_a_paused_run_run_again_goes_on_from_its_newest_healthy_checkpoint(tmp_path) -> None:
    """onCollapse: suspend pauses the run (exit 0) with a checkpoint of the collapse. Run
    again with the default --resume auto, it resumed that checkpoint, whose guard state
    holds the collapse, and paused after one step, on every try. It now goes on from the
    newest healthy checkpoint and finishes."""
    write_job(tmp_path, 12, checkpoint={"intervalSteps": 2}, stability={"onCollapse": "suspend"})
    run = start(tmp_path, [{"kind": "grad_scale", "from": 5, "to": 8, "factor": 1e40}])
    output = run.communicate(timeout=600)[0]
    assert run.returncode == 0 and "paused (a resume goes on from the newest" in output, output
    paused_at = max(records(tmp_path))
    assert 5 <= paused_at < 12, output
    again = start(tmp_path, [])
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 0, output
    assert f"the newest checkpoint, step {paused_at}, is the one the collapse guard's" in output
    assert "collapse at step" not in output, output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 12
    assert max(records(tmp_path)) == 12


def test_a_run_paused_before_any_healthy_checkpoint_starts_again_from_the_beginning(
    tmp_path,
) -> None:
    """A pause before the first healthy checkpoint: the only checkpoint to go on from was
    the pause's, and resumed it paused again after one step, on every try. Run again
    here, the run says so and leaves everything as it is (its folder holds results);
    restarted as the operator restarts it, it starts from the beginning, the newest
    healthy state, and finishes, and its commits abandon the paused checkpoint."""
    write_job(tmp_path, 10, checkpoint={"intervalSteps": 100}, stability={"onCollapse": "suspend"})
    run = start(tmp_path, [{"kind": "grad_scale", "from": 2, "to": 5, "factor": 1e40}])
    output = run.communicate(timeout=600)[0]
    assert run.returncode == 0 and "paused (a resume goes on from the newest" in output, output
    paused_at = max(records(tmp_path))
    checkpoints = tmp_path / "out" / "checkpoints"
    assert (checkpoints / f"step-{paused_at:06d}" / "manifest.json").exists()
    again = start(tmp_path, [])
    output = again.communicate(timeout=600)[0]
    assert again.returncode == 2, output
    assert f"the only checkpoint to go on from is step {paused_at}'s" in output, output
    assert (checkpoints / f"step-{paused_at:06d}" / "manifest.json").exists()
    restart = start(tmp_path, [], "--resume", "latest-healthy", RLFT_JOB_UID="uid-1")
    output = restart.communicate(timeout=600)[0]
    assert restart.returncode == 0, output
    assert f"the newest one, step {paused_at}, is the one the collapse guard's" in output
    assert "collapse at step" not in output, output
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 10
    assert min(records(tmp_path)) == 1  # the folder's metrics are this run's alone
    kept = sorted(p.name for p in checkpoints.glob("step-*"))
    assert kept == ["step-000010"], kept
