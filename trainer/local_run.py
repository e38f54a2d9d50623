"""`rlft train`: a whole job on this machine, in one process or on `--nproc` torchrun
ranks: optional SFT warm start, the job's algorithm, held-out evaluation, export.

Rank 0 owns the rollout engine, the rewards, the reference model and every file written;
all ranks train (FSDP2 when there are several).
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import yaml

from rlft.trainer.config import RLFineTune, dump_job
from rlft.trainer.data import build_task
from rlft.trainer.distributed import Dist
from rlft.trainer.encoding import Encoder
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.learner import Learner
from rlft.trainer.loops import Run, dpo_loop, rl_loop, sft_loop, warm_start
from rlft.trainer.modeling import build_critic, build_policy, count_parameters
from rlft.trainer.progress import Reporter
from rlft.trainer.resume import Checkpointing, Cursor, StopRequested
from rlft.trainer.rewards import RewardModel
from rlft.trainer.rollout import TransformersEngine
from rlft.trainer.supervisor import RunEnded, Supervisor
from rlft.trainer.tokenizer import stop_token_ids

RUN_FILES = ("metrics.jsonl", "summary.json", "model", "job.yaml")
RL_ALGORITHMS = ("grpo", "rloo", "reinforce++", "ppo")


class OutputExistsError(Exception):
    """The output folder already holds a run that would be overwritten."""


def existing_run_files(out: Path) -> list[str]:
    return [name for name in (*RUN_FILES, "checkpoints") if (out / name).exists()]


def prepare_output(out: Path, overwrite: bool) -> None:
    """Refuse to clobber a run (unless `overwrite`, which removes it, local checkpoints
    included); create the folder."""
    existing = existing_run_files(out)
    if existing and not overwrite:
        raise OutputExistsError(
            f"{out} already holds a run ({', '.join(existing)}) and no checkpoint to resume "
            "from; choose another --out or pass --overwrite to replace it"
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
    resume: str | int | None = None,
) -> dict:
    """Run the whole job; rank 0 writes metrics.jsonl, summary.json and model/ to `out`.

    `resume` (default `spec.checkpoint.resume`): `auto` continues from the newest
    checkpoint when there is one, `latest-healthy` from the newest healthy one, a step
    number from that step, `never` starts afresh. `overwrite` starts afresh too, after
    removing the previous run's files and local checkpoints.
    """
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
    resume = "never" if overwrite else (resume or spec.checkpoint.resume)
    existing = dist.broadcast(existing_run_files(out) if dist.is_main else None)
    if dist.is_main and (overwrite or not existing):
        prepare_output(out, overwrite)
    dist.barrier()
    learner = Learner(policy, spec.trainer, dist)
    run = Run(job, task, encoder, learner, dist, reporter, out=out)
    if dist.is_main:
        run.engine = TransformersEngine(
            learner.engine_model, tokenizer.pad_token_id, stop_token_ids(tokenizer)
        )
        run.rewards = rewards
    run.supervisor = Supervisor(job, dist, reporter.log)
    run.checkpoints = Checkpointing(job, out, dist, learner.engine_model, tokenizer, run.supervisor)
    try:
        cursor = None
        if resume != "never":
            _prepare_main_phase(run, policy.config)  # the shapes a checkpoint restores into
            cursor = run.checkpoints.resume(resume, learner, run.reference)
        if cursor is None and existing and not overwrite:
            prepare_output(out, overwrite=False)  # raises: a run is there, nothing to resume
        _announce(run, out, tokenizer, cursor)
        if cursor is None:
            cursor = _start_main_phase(run, policy.config)
        else:
            if run.engine is not None:
                run.engine.set_policy_version(cursor.policy_version)
                _truncate_metrics(out / "metrics.jsonl", cursor.step)
        run.cursor = cursor
        steps = min(spec.trainer.steps, max_steps) if max_steps is not None else spec.trainer.steps
        with (out / "metrics.jsonl").open("a") if dist.is_main else nullcontext() as metrics:
            run.metrics = metrics
            extra = _train(run, steps)
        run.checkpoints.final(cursor, learner, run.reference)
    except StopRequested as stop:
        reporter.log(f"rlft: {stop}; exiting so the job can resume later")
        return {"stopped_at_step": stop.step, "exit_code": ExitCode.OK}
    except RunEnded as ended:
        reporter.log(f"rlft: {ended}")
        return {"ended": str(ended), "exit_code": ended.code}
    finally:
        run.checkpoints.close()
        run.supervisor.close()

    eval_final = run.eval_accuracy()
    if not dist.is_main:
        return {}
    learner.engine_model.save_pretrained(out / "model", safe_serialization=True)
    tokenizer.save_pretrained(out / "model")
    eval_start = cursor.results["eval_accuracy_start"]
    summary = {
        "job": job.metadata.name,
        "algorithm": spec.algorithm.name,
        "world_size": dist.world,
        "steps": steps,
        "sft_steps": cursor.sft_steps,
        "policy_version": run.engine.policy_version,
        "eval_problems": len(task.eval_problems()[: spec.eval.max_problems]),
        "eval_accuracy_sft": eval_start,
        "eval_accuracy_final": eval_final,
        "eval_accuracy_gain": eval_final - eval_start,
        **extra,
        "parameters": count_parameters(learner.engine_model),
        "seed": spec.trainer.seed,
        "last_checkpoint_step": run.checkpoints.stats.last_step,
        "wall_time_s": round(time.perf_counter() - started, 2),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    reporter.log(
        f"rlft: held-out accuracy {eval_start:.3f} → {eval_final:.3f} after {steps} "
        f"{spec.algorithm.name} steps ({summary['wall_time_s']:.0f} s); "
        f"model saved to {out / 'model'}"
    )
    return summary


def _announce(run: Run, out: Path, tokenizer, cursor: Cursor | None) -> None:
    if not run.dist.is_main:
        return
    spec, model = run.spec, run.learner.engine_model
    (out / "job.yaml").write_text(yaml.safe_dump(dump_job(run.job), sort_keys=False))
    ranks = f", {run.dist.world} ranks (FSDP2)" if run.dist.active else ""
    run.reporter.log(
        f"rlft: job {run.job.metadata.name}: {count_parameters(model) / 1e6:.2f}M-parameter "
        f"{type(model).__name__}, vocabulary {len(tokenizer)}, {spec.algorithm.name}{ranks}, "
        f"output {out}"
    )
    if cursor is not None:
        run.reporter.log(
            f"rlft: resumed from the checkpoint of step {cursor.step} "
            f"({run.checkpoints.checkpointer.storage.uri})"
        )


def _prepare_main_phase(run: Run, config) -> None:
    """The main phase's optimizer, frozen reference and critic, from the current policy."""
    algorithm = run.spec.algorithm
    run.learner.reset_optimizer(run.spec.trainer.learning_rate)
    if algorithm.kl.coef > 0 or algorithm.name == "dpo":
        run.freeze_reference()
    if algorithm.name == "ppo":
        critic = _critic_from(config, run.learner.full_policy_state())
        run.learner.attach_critic(critic, algorithm.ppo.value_learning_rate)


def _start_main_phase(run: Run, config) -> Cursor:
    spec = run.spec
    sft_steps = warm_start(run) if spec.algorithm.sft.steps and spec.algorithm.name != "sft" else 0
    eval_start = run.eval_accuracy()
    run.reporter.log(f"rlft: held-out accuracy before {spec.algorithm.name}: {eval_start:.3f}")
    _prepare_main_phase(run, config)
    cursor = Cursor(spec.trainer.seed, sft_steps=sft_steps)
    cursor.results["eval_accuracy_start"] = eval_start
    return cursor


def _train(run: Run, steps: int) -> dict:
    name = run.spec.algorithm.name
    if name in RL_ALGORITHMS:
        rl_loop(run, steps)
        return {}
    if name == "dpo":
        return dpo_loop(run, steps)
    sft_loop(run, steps)
    return {}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after the checkpoint: the resumed run writes them again."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _critic_from(config, state):
    """Every rank builds the same critic from the policy's full weights."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config)
    base.load_state_dict(state)
    return build_critic(base)
