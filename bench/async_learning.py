"""Does the async pipeline learn as well as the synchronous loop on a real task? The
`make run` job (SFT warm start, then GRPO with an exact-match reward on 2-digit addition)
through one local rollout server, with `maxStaleness` 0 and 2, side by side; trainer and
server pinned to CPUs 0 and 1 as in `async_vs_sync.py`.

Prints held-out accuracy before and after RL, the training reward per 25-step window,
mean staleness and dropped samples per mode. Last line: JSON with both accuracies and
`accuracy_gap` (async minus synchronous). Takes ~10 minutes on 2 idle cores.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from async_vs_sync import ROOT, train_pinned

WINDOW = 25


def job(staleness: int) -> dict:
    document = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    rollout = document["spec"]["rollout"]
    rollout |= {"engine": "transformers", "local": "servers", "maxStaleness": staleness}
    document["metadata"]["name"] = f"bench-learning-{staleness}"
    return document


def main() -> int:
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlft-bench-learning-") as tmp:
        for staleness in (0, 2):
            out = train_pinned(job(staleness), Path(tmp), str(staleness))
            lines = (out / "metrics.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
            summary = json.loads((out / "summary.json").read_text())
            rewards = [r["reward_mean"] for r in records]
            results[staleness] = {
                "before": summary["eval_accuracy_sft"],
                "after": summary["eval_accuracy_final"],
                "windows": [
                    statistics.mean(rewards[i : i + WINDOW]) for i in range(0, len(rewards), WINDOW)
                ],
                "staleness": statistics.mean(r["staleness_mean"] for r in records),
                "dropped": sum(r["stale_dropped"] for r in records),
            }
    sync, stale = results[0], results[2]
    print("examples/tiny-grpo.yaml through one rollout server (transformers engine)")
    print(f"{'mode':<16}{'held-out before':>16}{'after':>8}{'staleness':>11}{'dropped':>9}")
    for k, r in results.items():
        name = "synchronous" if k == 0 else f"maxStaleness {k}"
        print(
            f"{name:<16}{r['before']:>16.3f}{r['after']:>8.3f}"
            f"{r['staleness']:>11.2f}{r['dropped']:>9.0f}"
        )
    print(f"training reward per {WINDOW}-step window:")
    for k, r in results.items():
        print(f"  maxStaleness {k}: " + " ".join(f"{x:.3f}" for x in r["windows"]))
    print(
        json.dumps(
            {
                "accuracy_sync": sync["after"],
                "accuracy_staleness_2": stale["after"],
                "accuracy_gap": round(stale["after"] - sync["after"], 4),
                "reward_last_window_sync": round(sync["windows"][-1], 4),
                "reward_last_window_staleness_2": round(stale["windows"][-1], 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
