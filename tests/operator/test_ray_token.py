"""Ray's token authentication as the operator renders it, on a real Ray (the one in
`.venv-vllm`, which multi-node rollout instances run): a head started with a ray-head
pod's environment takes a driver with a ray-worker pod's environment, and refuses a
driver without the job's token. Without the operator's variables a Ray head takes
anyone who reaches it, and its jobs API runs their code."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import job_doc, parsed
from processes import stop_process

from rlft.operator import manifests as M
from rlft.operator import names as N
from rlft.trainer.rollout.local import vllm_python

DRIVER = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print("nodes", sum(1 for node in ray.nodes() if node.get("Alive")))
"""


def container_env(pod: dict[str, Any], secret: dict[str, Any]) -> dict[str, str]:
    """The variables the kubelet would give the pod's container that come from a value or
    from the job's token Secret (field references are the pod's own, left out)."""
    out = {}
    for entry in pod["spec"]["containers"][0]["env"]:
        if "value" in entry:
            out[entry["name"]] = entry["value"]
            continue
        ref = entry["valueFrom"].get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == secret["metadata"]["name"], ref
            out[entry["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def without_ray_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


@pytest.fixture
def ray_bin() -> Path:
    python = vllm_python()
    assert python is not None, "Ray is not installed: run `make vllm` (builds .venv-vllm)"
    return Path(python).parent


def test_a_ray_head_with_the_operators_environment_refuses_a_driver_without_the_token(
    ray_bin: Path,
) -> None:
    job, body = parsed(
        job_doc(rollout={"engine": "vllm", "nodesPerInstance": 2, "gpusPerInstance": 2})
    )
    desired = M.desired(job, body, M.Settings(), "auto")
    (secret,) = [g for g in desired.guards if g["kind"] == "Secret"]
    secret = M.with_tokens(secret, "rollout-token-of-this-test", "ray-token-of-this-test")
    pods = {p["metadata"]["labels"][N.LABEL_ROLE]: p for p in desired.pods.values()}
    head_env = container_env(pods[N.ROLE_RAY_HEAD], secret)
    worker_env = container_env(pods[N.ROLE_RAY_WORKER], secret)
    assert head_env["RAY_AUTH_MODE"] == worker_env["RAY_AUTH_MODE"] == "token"
    assert head_env["RAY_AUTH_TOKEN"] == "ray-token-of-this-test"

    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    log = temp / "head.log"
    drivers: dict[str, subprocess.Popen] = {}
    with open(log, "w") as out:
        head = subprocess.Popen(
            [
                str(ray_bin / "ray"), "start", "--head", "--block",
                "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=1",
                "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}",
            ],
            env=without_ray_settings() | head_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

        def driver(env: dict[str, str]) -> subprocess.Popen:
            return subprocess.Popen(
                [str(ray_bin / "python"), "-c", DRIVER, f"127.0.0.1:{port}"],
                env=without_ray_settings() | env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

        # Side by side: a refused driver retries for about 20 s before it gives up.
        auth = {k: v for k, v in worker_env.items() if k.startswith("RAY_AUTH")}
        drivers["worker"] = driver(auth)
        drivers["stranger"] = driver({})
        drivers["wrong"] = driver({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "another-token"})
        ended = {name: (p, *p.communicate(timeout=180)) for name, p in drivers.items()}
        worker, out, err = ended["worker"]
        assert worker.returncode == 0 and "nodes 1" in out, err[-3000:]
        for name in ("stranger", "wrong"):
            refused, out, err = ended[name]
            assert refused.returncode != 0 and "nodes" not in out, (name, out, err[-3000:])
        assert "InvalidAuthToken" in ended["wrong"][2], ended["wrong"][2][-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):  # Ray's GCS and raylet: same group
            os.killpg(head.pid, signal.SIGKILL)
        for process in (head, *drivers.values()):
            stop_process(process)
        subprocess.run(["rm", "-rf", str(temp)], check=False)
