"""`rlft train`: a whole job on this machine, in one process or on `--nproc` torchrun
ranks: optional SFT warm start, the job's algorithm, held-out evaluation, export.

Rank 0 owns the rollout engine, the rewards, the reference model and every file written;
all ranks train (FSDP2 when there are several).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import yaml

from rlft.trainer.config import RLFineTune, dump_job
from rlft.trainer.data import build_task
from rlft.trainer.distributed import Dist
from rlft.trainer.encoding import Encoder
from rlft.trainer.learner import Learner
from rlft.trainer.loops import Run, dpo_loop, rl_loop, sft_loop, warm_start
from rlft.trainer.modeling import build_critic, build_policy, count_parameters
from rlft.trainer.progress import Reporter
from rlft.trainer.rewards import RewardModel
from rlft.trainer.rollout import TransformersEngine
from rlft.trainer.tokenizer import stop_token_ids

RUN_FILES = ("metrics.jsonl", "summary.json", "model", "job.yaml")
RL_ALGORITHMS = ("grpo", "rloo", "reinforce++", "ppo")


class OutputExistsError(Exception):
    """The output folder already holds a run that would be overwritten."""


def prepare_output(out: Path, overwrite: bool) -> None:
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not overwrite:
        raise OutputExistsError(
            f"{out} already holds a run ({', '.join(existing)}); "
            "choose another --out or pass --overwrite to replace it"
        )
    for name in existing:
        target = out / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    out.mkdir(parents=True, exist_ok=True)


def run_job(
    job: RLFineTune,
    out: Path,
    max_steps: int | None = None,
    overwrite: bool = False,
    reporter: Reporter | None = None,
    dist: Dist | None = None,
) -> dict:
    """Run the whole job; rank 0 writes metrics.jsonl, summary.json and model/ to `out`."""
    dist = dist or Dist()
    reporter = reporter or (Reporter() if dist.is_main else Reporter(interactive=False))
    if not dist.is_main:
        reporter.log = lambda message: None  # type: ignore[method-assign]
        reporter.advance = lambda done, info: None  # type: ignore[method-assign]
    spec = job.spec
    started = time.perf_counter()
    # Everything that can reject the job (data, rewards, model, output folder) runs
    # before anything is written, so a bad job leaves no half-made output behind.
    task = build_task(spec.data, spec.trainer.seed)
    rewards = RewardModel(spec.reward)
    policy, tokenizer = build_policy(spec.model, task.corpus(), spec.trainer.seed)
    encoder = Encoder(tokenizer, spec.data, stop_token_ids(tokenizer)[0])
    if dist.is_main:
        prepare_output(out, overwrite)
    dist.barrier()
    learner = Learner(policy, spec.trainer, dist)
    run = Run(job, task, encoder, learner, dist, reporter)
    if dist.is_main:
        run.engine = TransformersEngine(
            learner.engine_model, tokenizer.pad_token_id, stop_token_ids(tokenizer)
        )
        run.rewards = rewards
        if spec.rollout.engine != "transformers":
            reporter.log(
                f"rlft: warning: spec.rollout.engine={spec.rollout.engine!r} is not available "
                "to local runs yet; generating with the in-process transformers engine"
            )
        (out / "job.yaml").write_text(yaml.safe_dump(dump_job(job), sort_keys=False))
        ranks = f", {dist.world} ranks (FSDP2)" if dist.active else ""
        reporter.log(
            f"rlft: job {job.metadata.name}: {count_parameters(learner.engine_model) / 1e6:.2f}M-parameter "
            f"{type(learner.engine_model).__name__}, vocabulary {len(tokenizer)}, {spec.algorithm.name}"
            f"{ranks}, output {out}"
        )

    sft_steps = warm_start(run) if spec.algorithm.sft.steps and spec.algorithm.name != "sft" else 0
    eval_start = run.eval_accuracy()
    reporter.log(f"rlft: held-out accuracy before {spec.algorithm.name}: {eval_start:.3f}")

    steps = min(spec.trainer.steps, max_steps) if max_steps is not None else spec.trainer.steps
    extra: dict = {}
    metrics_file = (out / "metrics.jsonl").open("a") if dist.is_main else None
    run.metrics = metrics_file
    try:
        extra = _train(run, steps, policy.config)
    finally:
        if metrics_file is not None:
            metrics_file.close()

    eval_final = run.eval_accuracy()
    if not dist.is_main:
        return {}
    learner.engine_model.save_pretrained(out / "model", safe_serialization=True)
    tokenizer.save_pretrained(out / "model")
    summary = {
        "job": job.metadata.name,
        "algorithm": spec.algorithm.name,
        "world_size": dist.world,
        "steps": steps,
        "sft_steps": sft_steps,
        "policy_version": run.engine.policy_version,
        "eval_problems": len(task.eval_problems()[: spec.eval.max_problems]),
        "eval_accuracy_sft": eval_start,
        "eval_accuracy_final": eval_final,
        "eval_accuracy_gain": eval_final - eval_start,
        **extra,
        "parameters": count_parameters(learner.engine_model),
        "seed": spec.trainer.seed,
        "wall_time_s": round(time.perf_counter() - started, 2),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    reporter.log(
        f"rlft: held-out accuracy {eval_start:.3f} → {eval_final:.3f} after {steps} "
        f"{spec.algorithm.name} steps ({summary['wall_time_s']:.0f} s); "
        f"model saved to {out / 'model'}"
    )
    return summary


def _train(run: Run, steps: int, config) -> dict:
    algorithm = run.spec.algorithm
    if algorithm.kl.coef > 0 or algorithm.name == "dpo":
        run.freeze_reference()
    if algorithm.name == "ppo":
        run.learner.attach_critic(
            _critic_from(config, run.learner.full_policy_state()), algorithm.ppo.value_learning_rate
        )
    if algorithm.name in RL_ALGORITHMS:
        rl_loop(run, steps)
        return {}
    if algorithm.name == "dpo":
        return dpo_loop(run, steps)
    sft_loop(run, steps)
    return {}


def _critic_from(config, state):
    """Every rank builds the same critic from the policy's full weights."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config)
    base.load_state_dict(state)
    return build_critic(base)
