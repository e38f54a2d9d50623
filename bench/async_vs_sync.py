"""Async vs synchronous RL, side by side in one run: the same GRPO job, run with
`maxStaleness` 0 (synchronous), 1 and 2, through `rlft train` with one rollout server,
each on three seeds.

- Heavy-tailed response lengths from real generation: the policy is a small random
  Qwen3 whose end-of-text embedding is redrawn 20× larger than the others, so whether a
  completion stops depends strongly on its context: at the start half stop within 19
  tokens, a quarter within 3, and 18% run to maxNewTokens (128), as long chains of
  thought do; the slowest one holds up a synchronous step. (Redrawn 50× larger, the stop
  probability was so sensitive that one optimizer step at this learning rate made every
  completion stop at once, and a step of lag changed how the lengths evolved.)
- In every mode the trainer is pinned to CPU 0 and the rollout server to CPU 1
  (os.sched_setaffinity / RLFT_ROLLOUT_CPUS), as separate GPUs would be: the overlap is
  real, not two jobs fighting for the same cores. The trainer recomputes activations in
  the backward (activation checkpointing), as memory-bound trainers do, which sizes
  training and generation about equally (bound ≈ 2).
- Reward: the fraction of digits in the completion (a real, learnable signal). Reward
  curves per step are printed per mode (averaged over seeds), and the mean reward of the
  last 8 steps per seed, with its standard error across seeds: maxStaleness 2 counts as
  no worse than synchronous when it is not lower by more than two standard errors of
  the difference.

Per mode it also prints the compute of a step (longest completion, generation seconds
per batch, training seconds) and the work (mean length, tokens per step), so a speedup
that came from doing less per step would show.

Prints steps per hour, trainer idle ratio and the ideal overlap bound
`(T_gen + T_train) / max(T_gen, T_train)` measured in the synchronous run. Last line:
JSON with `speedup` (maxStaleness 2 over synchronous), `fraction_of_bound` and the
reward comparison.
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
SEEDS = [int(x) for x in os.environ.get("BENCH_SEEDS", "0,1,2").split(",")]
EOS_SCALE = 0.4  # the end-of-text embedding's entries: N(0, 0.4²) against the others' 0.02
TAIL = 8  # steps whose mean reward is compared between modes


def digit_reward(completion: str, answer: str) -> float:
    """Fraction of digit characters in the completion (the bench's reward term)."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def build_model(folder: Path) -> None:
    import torch

    from rlft.trainer.config import ModelInit, ModelSpec, TokenizerSpec
    from rlft.trainer.model.build import build_policy

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
        embedding[tokenizer.eos_token_id] = EOS_SCALE * torch.randn(
            embedding.shape[1], generator=torch.Generator().manual_seed(0)
        )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def job(model: Path, staleness: int, seed: int) -> dict:
    return {
        "apiVersion": "rlft.dev/v1alpha1",
        "kind": "RLFineTune",
        "metadata": {"name": f"bench-async-{staleness}-{seed}"},
        "spec": {
            "model": {"path": str(model)},
            "data": {"source": "arithmetic", "arithmetic": {"digits": 2, "evalSize": 8}},
            "reward": {"functions": [{"name": "async_vs_sync:digit_reward"}]},
            "algorithm": {
                "name": "grpo",
                "groupSize": 4,
                "sft": {"steps": 0},
            },
            "trainer": {
                "steps": STEPS,
                "promptsPerStep": PROMPTS_PER_STEP,
                "microBatchSize": 64,
                "learningRate": 0.0002,
                "warmupSteps": 4,
                "seed": seed,
                # as a memory-bound trainer runs: the backward recomputes the forward
                "parallelism": {"activationCheckpointing": True},
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
        "rlft.trainer.cli.main",
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


def run_mode(work: Path, staleness: int, seed: int) -> list[dict]:
    out = train_pinned(job(work / "model", staleness, seed), work, f"{staleness}-{seed}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(runs: list[list[dict]]) -> dict:
    """One mode over its seeds: timings over every timed step of every seed; the reward
    curve averaged over seeds; the last TAIL steps' mean reward per seed, with its
    standard error across seeds (the run-to-run noise a comparison must clear)."""
    timed = [r for records in runs for r in records[WARMUP:]]
    tails = [statistics.mean(r["reward_mean"] for r in records[-TAIL:]) for records in runs]

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in timed)

    return {
        "steps_per_hour": 3600 / mean("step_time_s"),
        "idle": mean("trainer_idle_ratio"),
        "t_gen": mean("gen_time_s"),
        "t_train": mean("train_time_s"),
        "batch_gen": mean("batch_gen_s"),
        "staleness_max": max(r["staleness_max"] for records in runs for r in records),
        "dropped": sum(r["stale_dropped"] for records in runs for r in records),
        "reward": [
            statistics.mean(r["reward_mean"] for r in step) for step in zip(*runs, strict=True)
        ],
        "tails": tails,
        "tail": statistics.mean(tails),
        "tail_se": statistics.stdev(tails) / len(tails) ** 0.5 if len(tails) > 1 else float("nan"),
        "len_mean": mean("response_len_mean"),
        "tokens": mean("tokens"),
        "len_max": mean("response_len_max"),
    }


def main() -> int:
    if len(os.sched_getaffinity(0)) < 2:
        print("bench/async_vs_sync.py needs 2 CPUs (trainer and rollout server pinned apart)")
        return 1
    with tempfile.TemporaryDirectory(prefix="rlft-bench-async-") as tmp:
        work = Path(tmp)
        build_model(work / "model")
        results = {k: summary([run_mode(work, k, seed) for seed in SEEDS]) for k in (0, 1, 2)}
    sync = results[0]
    bound = (sync["t_gen"] + sync["t_train"]) / max(sync["t_gen"], sync["t_train"])
    print(
        f"GRPO, {PROMPTS_PER_STEP}×4 completions/step, maxNewTokens 128 (heavy-tailed lengths), "
        f"{STEPS} steps (first {WARMUP} not timed), seeds {SEEDS}; trainer on CPU 0, "
        "rollout server on CPU 1"
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
            f"{r['len_max']:>9.1f}{r['batch_gen']:>13.3f}{r['t_train']:>9.3f}{r['tokens']:>13.0f}"
        )
    print(f"reward per step (mean of completions, averaged over {len(SEEDS)} seeds):")
    for k, r in results.items():
        print(f"  maxStaleness {k}: " + " ".join(f"{x:.3f}" for x in r["reward"]))
    print(f"mean reward of the last {TAIL} steps, per seed and mean ± standard error:")
    for k, r in results.items():
        seeds = " ".join(f"{x:.4f}" for x in r["tails"])
        print(f"  maxStaleness {k}: {seeds}   {r['tail']:.4f} ± {r['tail_se']:.4f}")
    # No worse within noise: the async mean is not below the synchronous one by more than
    # two standard errors of the difference.
    noise = 2 * (sync["tail_se"] ** 2 + results[2]["tail_se"] ** 2) ** 0.5
    gap = results[2]["tail"] - sync["tail"]
    print(f"maxStaleness 2 minus synchronous: {gap:+.4f} (two standard errors: {noise:.4f})")
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
                "reward_tail_sync": round(sync["tail"], 4),
                "reward_tail_staleness_2": round(results[2]["tail"], 4),
                "reward_tail_two_se": round(noise, 4),
                "reward_no_worse_within_noise": gap >= -noise,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
