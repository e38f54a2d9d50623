"""Does the accuracy gain of `make run` hinge on its seed? Runs examples/tiny-grpo.yaml
with several seeds, side by side, and prints SFT vs final held-out accuracy for each.

    .venv/bin/python bench/tiny_grpo_seeds.py [--seeds 0 1 2] [--parallel 2]

Last line: JSON with every seed's gain and the smallest one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "tiny-grpo.yaml"


def launch(seed: int, workdir: Path, threads: int) -> tuple[subprocess.Popen, Path]:
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["trainer"]["seed"] = seed
    job_path = workdir / f"seed{seed}.yaml"
    job_path.write_text(yaml.safe_dump(job))
    out = workdir / f"seed{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [
        sys.executable,
        "-m",
        "rlft.trainer.cli.main",
        "train",
        str(job_path),
        "--out",
        str(out),
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return process, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time")
    args = parser.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.parallel)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        pending = list(args.seeds)
        while pending:
            batch, pending = pending[: args.parallel], pending[args.parallel :]
            running = [(seed, *launch(seed, Path(tmp), threads)) for seed in batch]
            for seed, process, out in running:
                _, stderr = process.communicate()
                if process.returncode:
                    sys.exit(f"seed {seed} failed:\n{stderr.decode()[-2000:]}")
                results[seed] = json.loads((out / "summary.json").read_text())
    print(f"{'seed':>4}  {'SFT acc':>8}  {'final acc':>9}  {'gain':>6}  {'wall s':>7}")
    for seed, summary in results.items():
        sft, final = summary["eval_accuracy_sft"], summary["eval_accuracy_final"]
        print(
            f"{seed:>4}  {sft:>8.3f}  {final:>9.3f}"
            f"  {final - sft:>+6.3f}  {summary['wall_time_s']:>7.0f}"
        )
    gains = {seed: round(s["eval_accuracy_gain"], 4) for seed, s in results.items()}
    print(json.dumps({"gains": gains, "min_gain": min(gains.values())}))


if __name__ == "__main__":
    main()
