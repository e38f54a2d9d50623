"""Soak check of the trainer: a tiny async GRPO job with two local rollout servers
(weights by broadcast) runs for many steps, checkpointing often, while this script reads
the trainer process's resident memory, open file descriptors and threads from /proc
every few seconds. A trainer that keeps something per step (a growing history, a
connection or thread per request) shows here long before a week-long run meets its
memory limit. Runs the job three times: with and without checkpoints, and with
checkpoints under glibc's own mmap threshold fixed (`MALLOC_MMAP_THRESHOLD_=131072`, where
`rlft train` fixes 4 MiB: trainer/allocator.py, which says why); prints the growth side
by side. The last line is JSON.

    .venv/bin/python bench/soak.py [--steps 3000] [--checkpoint-every 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RLFT = REPO / ".venv" / "bin" / "rlft"
sys.path.insert(0, str(REPO / "tests"))

from tiny_jobs import TINY_INIT  # noqa: E402


def _job(steps: int, every: int) -> dict:
    spec = {
        "model": {"init": TINY_INIT | {"hiddenSize": 64}, "tokenizer": {"kind": "byte"}},
        "data": {"source": "arithmetic", "arithmetic": {"digits": 2, "evalSize": 16}},
        "algorithm": {"sft": {"steps": 5, "batchSize": 16, "warmupSteps": 1}, "groupSize": 4},
        "trainer": {"steps": steps, "promptsPerStep": 4, "microBatchSize": 16},
        "rollout": {
            "sampling": {"maxNewTokens": 4},
            "local": "servers",
            "instances": 2,
            "maxStaleness": 2,
            "publication": "broadcast",
        },
        "checkpoint": {"intervalSteps": every},
        "eval": {"maxProblems": 16, "everySteps": 50},
    }
    return {"apiVersion": "rlft.dev/v1alpha1", "kind": "RLFineTune",
            "metadata": {"name": "soak"}, "spec": spec}  # fmt: skip


def _status(pid: int) -> tuple[int, int, int]:
    """(resident KiB, open fds, threads) of `pid`."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    rss = int(fields["VmRSS"].split()[0])
    return rss, len(os.listdir(f"/proc/{pid}/fd")), int(fields["Threads"])


def _servers(pid: int) -> list[int]:
    """The trainer's rollout servers: its child processes running `rlft.trainer.rollout.server`."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):  # any thread may start one
        with contextlib.suppress(OSError):
            children += task.read_text().split()
    found = []
    for child in children:
        with contextlib.suppress(OSError):
            if b"rlft.trainer.rollout.server" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
    return found


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def soak(folder: Path, steps: int, every: int, environ: dict[str, str] | None = None) -> dict:
    """Run the job; RSS growth from a third of the steps (past the warm-up: allocator
    arenas, caches and the pipeline filling) to the end."""
    folder.mkdir(parents=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(_job(steps, every)))
    env = dict(os.environ, RLFT_POD_IP="127.0.0.7", OMP_NUM_THREADS="1", **(environ or {}))
    with (folder / "train.log").open("w") as log:
        process = subprocess.Popen(
            [str(RLFT), "train", "job.yaml", "--out", "out"],
            cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        samples: list[tuple[int, int, int, int]] = []
        servers: dict[int, list[tuple[int, int]]] = {}  # pid → [(step, resident KiB)]
        try:
            while process.poll() is None:
                step = _last_step(folder / "out" / "metrics.jsonl")
                with contextlib.suppress(OSError, KeyError):  # it ended meanwhile
                    samples.append((step, *_status(process.pid)))
                for server in _servers(process.pid):
                    with contextlib.suppress(OSError, KeyError):
                        servers.setdefault(server, []).append((step, _status(server)[0]))
                time.sleep(2)
        finally:
            process.kill()
            process.wait()
    if process.returncode != 0:
        raise SystemExit(f"the job failed (exit {process.returncode}): {folder / 'train.log'}")
    running = [s for s in samples if steps // 3 <= s[0] < steps]
    first, last = running[0], running[-1]
    served = [[s for s in series if steps // 3 <= s[0] < steps] for series in servers.values()]
    served = [s for s in served if len(s) > 1]  # a server replaced mid-run has its own series
    extras = sorted((folder / "out" / "checkpoints").glob("step-*/extra.json"))
    return {
        "steps": steps,
        "checkpoint_every": every,
        "rss_mib": [round(first[1] / 1024, 1), round(last[1] / 1024, 1)],
        "rss_growth_kib_per_step": round((last[1] - first[1]) / max(1, last[0] - first[0]), 2),
        "server_rss_mib": [[round(s[0][1] / 1024, 1), round(s[-1][1] / 1024, 1)] for s in served],
        "server_growth_kib_per_step": [
            round((s[-1][1] - s[0][1]) / max(1, s[-1][0] - s[0][0]), 2) for s in served
        ],
        "fds": [min(s[2] for s in running), max(s[2] for s in running)],
        "threads": [min(s[3] for s in running), max(s[3] for s in running)],
        "last_extra_json_bytes": extras[-1].stat().st_size if extras else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlft-soak-") as scratch:
        runs = {
            "checkpoints": soak(Path(scratch) / "a", args.steps, args.checkpoint_every),
            "no_checkpoints": soak(Path(scratch) / "b", args.steps, 10**6),
            "checkpoints_fixed_mmap": soak(
                Path(scratch) / "c", args.steps, args.checkpoint_every,
                {"MALLOC_MMAP_THRESHOLD_": "131072"},
            ),
        }  # fmt: skip
    for name, run in runs.items():
        print(
            f"{name:>22}: RSS {run['rss_mib'][0]} → {run['rss_mib'][1]} MiB "
            f"({run['rss_growth_kib_per_step']} KiB/step), fds {run['fds']}, "
            f"threads {run['threads']}, last extra.json {run['last_extra_json_bytes']} B; "
            f"rollout servers {run['server_rss_mib']} MiB "
            f"({run['server_growth_kib_per_step']} KiB/step)"
        )
    print(json.dumps({"machine": os.uname().nodename, "cores": os.cpu_count(), **runs}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
