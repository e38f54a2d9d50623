"""Async vs synchronous RL, side by side in one run: the same GRPO job, run with
`maxStaleness` 0 (synchronous), 1 and 2, through `rlft train` with one rollout server.

- Heavy-tailed response lengths from real generation: the policy is a small random
  Qwen3 whose end-of-text embedding is redrawn so that most completions stop within a few
  tokens and a few run to maxNewTokens (median ≈ 3, p90 ≈ 70 of 128 tokens), as long
  chains of thought do; the slowest one holds up a synchronous step.
- In every mode the trainer is pinned to CPU 0 and the rollout server to CPU 1
  (os.sched_setaffinity / RLFT_ROLLOUT_CPUS), as separate GPUs would be: the overlap is
  real, not two jobs fighting for the same cores.
- Reward: the fraction of digits in the completion (a real, learnable signal; the
  per-step reward curves of the modes are printed side by side).

Per mode it also prints the compute of a step (longest completion, generation seconds
per batch, training seconds) and the work (mean length, tokens per step), so a speedup
that came from doing less per step would show.

Prints steps per hour, trainer idle ratio and the ideal overlap bound
`(T_gen + T_train) / max(T_gen, T_train)` measured in the synchronous run. Last line:
JSON with `speedup` (maxStaleness 2 over synchronous) and `fraction_of_bound`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = int(os.environ.get("BENCH_STEPS", "24"))
WARMUP = 3  # first steps (server start, first weight loads) left out of the timings
PROMPTS_PER_STEP = int(os.environ.get("BENCH_PROMPTS", "16"))


def digit_reward(completion: str, answer: str) -> float:
    """Fraction of digit characters in the completion (the bench's reward term)."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def build_model(folder: Path) -> None:
    import torch

    from rlft.trainer.config import ModelInit, ModelSpec, TokenizerSpec
    from rlft.trainer.modeling import build_policy

    spec = ModelSpec(
        init=ModelInit(
            family="qwen3",
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=4,
            intermediate_size=256,
            max_position_embeddings=160,
        ),
        tokenizer=TokenizerSpec(kind="byte"),
    )
    model, tokenizer = build_policy(spec, [], 0)
    with torch.no_grad():  # heavy-tailed stopping: a redrawn end-of-text embedding
        embedding = model.get_input_embeddings().weight
        embedding[tokenizer.eos_token_id] = torch.randn(
            embedding.shape[1], generator=torch.Generator().manual_seed(0)
        )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def job(model: Path, staleness: int) -> dict:
    return {
        "apiVersion": "rlft.dev/v1alpha1",
        "kind": "RLFineTune",
        "metadata": {"name": f"bench-async-{staleness}"},
        "spec": {
            "model": {"path": str(model)},
            "data": {"source": "arithmetic", "arithmetic": {"digits": 2, "evalSize": 8}},
            "reward": {"functions": [{"name": "async_vs_sync:digit_reward"}]},
            "algorithm": {"name": "grpo", "groupSize": 4, "sft": {"steps": 0}},
            "trainer": {
                "steps": STEPS,
                "promptsPerStep": PROMPTS_PER_STEP,
                "microBatchSize": 64,
                "learningRate": 0.00002,
                "warmupSteps": 1,
                "seed": 0,
            },
            "rollout": {
                "local": "servers",
                "instances": 1,
                "maxStaleness": staleness,
                "sampling": {"maxNewTokens": 128},
            },
            "eval": {"maxProblems": 4},
        },
    }


def train_pinned(document: dict, work: Path, name: str) -> Path:
    """`rlft train` on the job with the trainer pinned to CPU 0 and its rollout servers to
    CPU 1 (RLFT_ROLLOUT_CPUS), one thread each; returns the run folder."""
    import yaml

    path = work / f"job-{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    out = work / f"run-{name}"
    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "RLFT_ROLLOUT_CPUS": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")])
        ),
    }
    command = [
        sys.executable,
        "-m",
        "rlft.trainer.cli",
        "train",
        str(path),
        "--out",
        str(out),
        "--overwrite",
    ]
    subprocess.run(
        command,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, {0}),
    )
    return out


def run_mode(work: Path, model: Path, staleness: int) -> list[dict]:
    out = train_pinned(job(model, staleness), work, str(staleness))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(records: list[dict]) -> dict:
    timed = records[WARMUP:]
    step = statistics.mean(r["step_time_s"] for r in timed)
    return {
        "steps_per_hour": 3600 / step,
        "idle": statistics.mean(r["trainer_idle_ratio"] for r in timed),
        "t_gen": statistics.mean(r["gen_time_s"] for r in timed),
        "t_train": statistics.mean(r["train_time_s"] for r in timed),
        "batch_gen": statistics.mean(r["batch_gen_s"] for r in timed),
        "staleness_max": max(r["staleness_max"] for r in records),
        "dropped": sum(r["stale_dropped"] for r in records),
        "reward": [r["reward_mean"] for r in records],
        "len_mean": statistics.mean(r["response_len_mean"] for r in timed),
        "tokens": statistics.mean(r["tokens"] for r in timed),
        "len_max": statistics.mean(r["response_len_max"] for r in timed),
        "train": statistics.mean(r["train_time_s"] for r in timed),
    }


def main() -> int:
    if len(os.sched_getaffinity(0)) < 2:
        print("bench/async_vs_sync.py needs 2 CPUs (trainer and rollout server pinned apart)")
        return 1
    with tempfile.TemporaryDirectory(prefix="rlft-bench-async-") as tmp:
        work = Path(tmp)
        build_model(work / "model")
        results = {k: summary(run_mode(work, work / "model", k)) for k in (0, 1, 2)}
    sync = results[0]
    bound = (sync["t_gen"] + sync["t_train"]) / max(sync["t_gen"], sync["t_train"])
    print(
        f"GRPO, {PROMPTS_PER_STEP}×4 completions/step, maxNewTokens 128 (heavy-tailed lengths), "
        f"{STEPS} steps (first {WARMUP} not timed); trainer on CPU 0, rollout server on CPU 1"
    )
    t_gen, t_train = sync["t_gen"], sync["t_train"]
    print(f"synchronous run: T_gen {t_gen:.3f} s, T_train {t_train:.3f} s → bound {bound:.2f}×")
    header = ("mode", "steps/hour", "speedup", "of bound", "idle", "max lag", "dropped", "len")
    header += ("max len", "gen s/batch", "train s", "tokens/step")
    widths = (16, 12, 9, 10, 7, 9, 9, 7, 9, 13, 9, 13)
    cells = [
        f"{h:<{w}}" if i == 0 else f"{h:>{w}}"
        for i, (h, w) in enumerate(zip(header, widths, strict=True))
    ]
    print("".join(cells))
    for k, r in results.items():
        speed = r["steps_per_hour"] / sync["steps_per_hour"]
        name = "synchronous" if k == 0 else f"maxStaleness {k}"
        print(
            f"{name:<16}{r['steps_per_hour']:>12.0f}{speed:>8.2f}×{speed / bound:>10.2f}"
            f"{r['idle']:>7.2f}{r['staleness_max']:>9.0f}{r['dropped']:>9.0f}{r['len_mean']:>7.1f}"
            f"{r['len_max']:>9.1f}{r['batch_gen']:>13.3f}{r['train']:>9.3f}{r['tokens']:>13.0f}"
        )
    print("reward per step (mean of completions):")
    for k, r in results.items():
        print(f"  maxStaleness {k}: " + " ".join(f"{x:.2f}" for x in r["reward"]))
    for k, r in results.items():
        tail = r["reward"][-8:]
        print(f"  maxStaleness {k}: mean of the last 8 steps {statistics.mean(tail):.3f}")
    speedup = results[2]["steps_per_hour"] / sync["steps_per_hour"]
    print(
        json.dumps(
            {
                "speedup": round(speedup, 3),
                "fraction_of_bound": round(speedup / bound, 3),
                "bound": round(bound, 3),
                "speedup_staleness_1": round(
                    results[1]["steps_per_hour"] / sync["steps_per_hour"], 3
                ),
                "idle_sync": round(sync["idle"], 3),
                "idle_staleness_2": round(results[2]["idle"], 3),
                "reward_last8_sync": round(statistics.mean(sync["reward"][-8:]), 4),
                "reward_last8_staleness_2": round(statistics.mean(results[2]["reward"][-8:]), 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
