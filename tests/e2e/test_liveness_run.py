"""A hung rank in a real two-pod gang (two torchrun agents, as the operator starts them,
without a cluster): a hang planted in rank 1 before a step's first collective stops both
ranks; each pod's liveness endpoint answers 200 while they train and 503 once they made
no progress for stallTimeoutSeconds, and both ranks' termination messages say `stalled`
before anything kills them (the kill itself is the kubelet's: tests/cluster)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from processes import kill_tree, private_tmp
from tiny_jobs import arithmetic_rl_spec, write_parity_job

from rlft.trainer import termination

STALL = 15


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _pod(folder: Path, pod: str, rdzv: int, liveness: int) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=str(folder),
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        RLFT_LIVENESS_PORT=str(liveness),
        RLFT_POD_IP="127.0.0.1",
        RLFT_TERMINATION_LOG=str(folder / f"{pod}.termination"),
        RLFT_PLANT_FAULTS=json.dumps([{"kind": "hang", "rank": 1, "at": 3}]),
        TMPDIR=str(private_tmp(folder / f"{pod}-tmp")),  # a pod's own /tmp (torchelastic_*)
    )
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv}", "--rdzv-id=hang"),
        *("--max-restarts=0", "-m", "rlft.trainer.cli.main", "train", "job.yaml"),
        *("--out", pod),
    ]
    log = (folder / f"{pod}.log").open("w")
    return subprocess.Popen(
        command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None  # not serving (yet)


def test_a_hung_rank_stops_answering_and_says_it_stalled(tmp_path):
    spec = arithmetic_rl_spec({"name": "grpo", "groupSize": 4}, steps=6)
    spec["trainer"]["stallTimeoutSeconds"] = STALL
    write_parity_job(tmp_path, spec, "hang")
    ports = [free_port(), free_port()]
    rdzv = free_port()
    pods = [_pod(tmp_path, f"pod-{i}", rdzv, ports[i]) for i in range(2)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    seen: list[list[tuple[float, int | None, int | None]]] = [[], []]
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            for i, url in enumerate(urls):
                seen[i].append((time.monotonic(), status(f"{url}/livez"), status(f"{url}/started")))
            if all(s[-1][1] == 503 for s in seen) or any(p.poll() is not None for p in pods):
                break
            time.sleep(0.5)
        logs = "".join((tmp_path / f"pod-{i}.log").read_text(errors="replace") for i in range(2))
        assert "planted fault: rank 1 hangs at step 3" in logs, logs[-4000:]
        for i in range(2):
            answers = [live for _, live, _ in seen[i]]
            started = [t for t, _, begun in seen[i] if begun == 200]
            assert started, (i, seen[i][-5:], logs[-3000:])  # the loop began
            assert 200 in answers and answers[-1] == 503, (i, answers[-10:], logs[-3000:])
            verdict = termination.read((tmp_path / f"pod-{i}.termination").read_text())
            assert verdict is not None and verdict.stalled, (i, verdict)
            assert "made no progress for" in verdict.message, verdict.message
        assert all(p.poll() is None for p in pods)  # stalled, not crashed: the kubelet kills
    finally:
        for pod in pods:  # the agents and their workers (in sessions of their own)
            kill_tree(pod)
