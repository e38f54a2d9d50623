"""A real collapse, not a planted one: examples/tiny-grpo.yaml with its RL learning rate
raised (2e-3, 4× the default) drives the training reward towards 0. Run side by side:

- `alert` — the guard only reports (onCollapse: alert): what the run does on its own;
- `rollback` — rlft's default: the collapse is caught, the run is rolled back to the
  newest healthy checkpoint (every 10 steps) with the learning rate halved, and goes on.

    .venv/bin/python bench/real_collapse.py [--lr 2e-3] [--steps 300]

Prints, per mode: the step the guard first flagged the run, the step it declared the
collapse (and acted), the first step the training reward hit 0, rollbacks, and held-out
accuracy after SFT and at the end. Last line: JSON.
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


def launch(mode: str, lr: float, steps: int, workdir: Path) -> tuple[subprocess.Popen, Path]:
    job = yaml.safe_load(JOB.read_text())
    job["spec"]["trainer"] |= {"learningRate": lr, "steps": steps}
    job["spec"]["checkpoint"] = {"intervalSteps": 10, "keepLast": 3}
    job["spec"]["stability"] = {"onCollapse": mode}
    path = workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(job))
    out = workdir / mode
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "rlft.trainer.cli.main", "train", str(path), "--out", str(out)]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ), out


def summarise(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())

    def first(predicate) -> int | None:
        return next((r["step"] for r in records if predicate(r)), None)

    return {
        "first_flag_step": first(lambda r: r.get("guard_action", "apply") != "apply"),
        "collapse_step": first(lambda r: r.get("guard_action") in ("rollback", "pause", "fail")),
        "reward_zero_step": first(lambda r: r["reward_mean"] == 0.0),
        "rollbacks": sum(r.get("guard_action") == "rollback" for r in records),
        "skips": sum(r.get("guard_action") == "skip" for r in records),
        "final_reward_mean": sum(r["reward_mean"] for r in records[-10:]) / 10,
        "eval_accuracy_sft": summary["eval_accuracy_sft"],
        "eval_accuracy_final": summary["eval_accuracy_final"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        running = {m: launch(m, args.lr, args.steps, Path(tmp)) for m in ("alert", "rollback")}
        for mode, (process, out) in running.items():
            output = process.communicate()[0]
            if process.returncode:
                sys.exit(f"{mode} run failed:\n{output[-3000:]}")
            results[mode] = summarise(out)
    keys = list(results["alert"])
    print(f"RL learning rate {args.lr:g}, {args.steps} steps, checkpoints every 10 steps")
    print(f"{'':>22}" + "".join(f"{mode:>12}" for mode in results))
    for key in keys:
        cells = "".join(f"{_cell(results[mode][key]):>12}" for mode in results)
        print(f"{key:>22}{cells}")
    print(json.dumps({"lr": args.lr, **results}))


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
