"""`rlft train`: a whole job on one machine: SFT warm start, then GRPO, then export.

Rollouts come from the in-process transformers engine, which shares the policy's
weights, so the policy version it reports is always the trainer's.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from rlft.trainer.algorithms.advantages import group_relative_advantages
from rlft.trainer.algorithms.losses import (
    grpo_token_losses,
    masked_sum,
    sft_token_losses,
    token_entropy,
    token_logprobs,
    token_mean,
)
from rlft.trainer.batch import SequenceBatch, pack
from rlft.trainer.config import RLFineTune, dump_job
from rlft.trainer.data import Problem, Task, build_task
from rlft.trainer.evaluate import greedy_accuracy
from rlft.trainer.modeling import build_policy, count_parameters
from rlft.trainer.progress import Reporter
from rlft.trainer.rewards import RewardModel
from rlft.trainer.rollout import SamplingParams, TransformersEngine
from rlft.trainer.tokenizer import stop_token_ids

RUN_FILES = ("metrics.jsonl", "summary.json", "model", "job.yaml")


class OutputExistsError(Exception):
    """The output folder already holds a run that would be overwritten."""


@dataclass
class RunContext:
    job: RLFineTune
    task: Task
    model: torch.nn.Module
    tokenizer: object
    engine: TransformersEngine
    rewards: RewardModel
    reporter: Reporter

    def encode_prompt(self, text: str) -> list[int]:
        chat = self.job.spec.data.source == "jsonl" and self.job.spec.data.jsonl.chat
        if chat:
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_answer(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [
            self.engine.stop_ids[0].item()
        ]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def eval_accuracy(self) -> float:
        """Greedy exact-match accuracy on the held-out problems."""
        return self.accuracy(self.task.eval_problems()[: self.job.spec.eval.max_problems])

    def accuracy(self, problems: list[Problem]) -> float:
        return greedy_accuracy(
            self.engine,
            problems,
            self.encode_prompt,
            self.decode,
            self.job.spec.rollout.sampling.max_new_tokens,
        )


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
) -> dict:
    """Run the whole job; write metrics.jsonl, summary.json and model/ under `out`."""
    reporter = reporter or Reporter()
    spec = job.spec
    started = time.perf_counter()
    # Everything that can reject the job (data, rewards, model) runs before anything is
    # written, so a bad job leaves no half-made output folder behind.
    task = build_task(spec.data, spec.trainer.seed)
    rewards = RewardModel(spec.reward)
    model, tokenizer = build_policy(spec.model, task.corpus(), spec.trainer.seed)
    engine = TransformersEngine(model, tokenizer.pad_token_id, stop_token_ids(tokenizer))
    ctx = RunContext(job, task, model, tokenizer, engine, rewards, reporter)
    if spec.rollout.engine != "transformers":
        reporter.log(
            f"rlft: warning: spec.rollout.engine={spec.rollout.engine!r} is not available to "
            "local runs yet; generating with the in-process transformers engine"
        )
    prepare_output(out, overwrite)
    (out / "job.yaml").write_text(yaml.safe_dump(dump_job(job), sort_keys=False))
    reporter.log(
        f"rlft: job {job.metadata.name}: {count_parameters(model) / 1e6:.2f}M-parameter "
        f"{type(model).__name__}, vocabulary {len(tokenizer)}, output {out}"
    )

    sft_steps = warm_start(ctx, seed=spec.trainer.seed) if spec.algorithm.sft.steps else 0
    eval_sft = ctx.eval_accuracy()
    reporter.log(f"rlft: held-out accuracy after the warm start: {eval_sft:.3f}")

    steps = min(spec.trainer.steps, max_steps) if max_steps is not None else spec.trainer.steps
    train_grpo(ctx, steps, out / "metrics.jsonl")

    eval_final = ctx.eval_accuracy()
    model.save_pretrained(out / "model", safe_serialization=True)
    tokenizer.save_pretrained(out / "model")
    summary = {
        "job": job.metadata.name,
        "algorithm": spec.algorithm.name,
        "steps": steps,
        "sft_steps": sft_steps,
        "policy_version": engine.policy_version,
        "eval_problems": len(task.eval_problems()[: spec.eval.max_problems]),
        "eval_accuracy_sft": eval_sft,
        "eval_accuracy_final": eval_final,
        "eval_accuracy_gain": eval_final - eval_sft,
        "parameters": count_parameters(model),
        "seed": spec.trainer.seed,
        "wall_time_s": round(time.perf_counter() - started, 2),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    reporter.log(
        f"rlft: held-out accuracy {eval_sft:.3f} after SFT → {eval_final:.3f} after "
        f"{steps} RL steps ({summary['wall_time_s']:.0f} s); model saved to {out / 'model'}"
    )
    return summary


def _warmup(step: int, warmup_steps: int, peak: float) -> float:
    """Linear warm-up over `warmup_steps`, then constant."""
    return peak * min(1.0, step / max(1, warmup_steps))


def warm_start(ctx: RunContext, seed: int) -> int:
    """Supervised fine-tuning on reference answers: the standard start before RL.
    Returns the number of steps taken."""
    sft = ctx.job.spec.algorithm.sft
    trainer = ctx.job.spec.trainer
    rng = random.Random(seed + 1)
    probe_rng = random.Random(seed + 2)
    optimizer = torch.optim.AdamW(ctx.model.parameters(), lr=sft.learning_rate, weight_decay=0.0)
    ctx.model.train()
    ctx.reporter.start("SFT warm start", sft.steps)
    for step in range(sft.steps):
        for group in optimizer.param_groups:
            group["lr"] = _warmup(step + 1, sft.warmup_steps, sft.learning_rate)
        problems = [ctx.task.train_problem(rng) for _ in range(sft.batch_size)]
        batch = pack(
            [ctx.encode_prompt(p.prompt) for p in problems],
            [ctx.encode_answer(p.answer) for p in problems],
            ctx.tokenizer.pad_token_id,
        )
        optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        for micro in _micro_batches(batch, trainer.micro_batch_size):
            logits = ctx.model(
                input_ids=micro.input_ids, attention_mask=micro.attention_mask
            ).logits
            loss = token_mean(sft_token_losses(logits, micro.targets), micro.mask, batch.tokens)
            loss.backward()
            loss_total += loss.item()
        torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), trainer.grad_clip)
        optimizer.step()
        ctx.reporter.advance(step + 1, f"loss {loss_total:.3f}")
        if sft.stop_at_accuracy is not None and (step + 1) % sft.probe_every_steps == 0:
            probe = [ctx.task.train_problem(probe_rng) for _ in range(sft.probe_problems)]
            accuracy = ctx.accuracy(probe)
            if accuracy >= sft.stop_at_accuracy:
                ctx.reporter.stop()
                ctx.reporter.log(
                    f"rlft: warm start reached {accuracy:.3f} on a probe of training problems "
                    f"after {step + 1} steps (target {sft.stop_at_accuracy}); starting RL"
                )
                return step + 1
    ctx.reporter.stop()
    return sft.steps


def _micro_batches(batch: SequenceBatch, size: int):
    for start in range(0, len(batch), size):
        yield batch.slice(start, start + size)


def train_grpo(ctx: RunContext, steps: int, metrics_path: Path) -> None:
    """GRPO: sample groups, score, group-relative advantages, clipped surrogate."""
    spec = ctx.job.spec
    grpo = spec.algorithm.grpo
    trainer = spec.trainer
    sampling = SamplingParams(
        temperature=spec.rollout.sampling.temperature,
        top_p=spec.rollout.sampling.top_p,
        max_new_tokens=spec.rollout.sampling.max_new_tokens,
    )
    rng = random.Random(trainer.seed)
    generator = torch.Generator().manual_seed(trainer.seed)
    reference = _frozen_copy(ctx.model) if grpo.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(
        ctx.model.parameters(), lr=trainer.learning_rate, weight_decay=trainer.weight_decay
    )
    ctx.reporter.start("GRPO", steps)
    with metrics_path.open("a") as metrics_file:
        for step in range(1, steps + 1):
            lr = _warmup(step, trainer.warmup_steps, trainer.learning_rate)
            for group in optimizer.param_groups:
                group["lr"] = lr
            record = grpo_step(ctx, rng, generator, sampling, optimizer, reference)
            record = {"step": step, "policy_version": ctx.engine.policy_version, "lr": lr, **record}
            if spec.eval.every_steps and step % spec.eval.every_steps == 0 and step < steps:
                record["eval_accuracy"] = ctx.eval_accuracy()
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            ctx.reporter.advance(
                step,
                f"reward {record['reward_mean']:.3f} acc {record['train_accuracy']:.2f} "
                f"loss {record['loss']:+.4f} gnorm {record['grad_norm']:.3f}",
            )
    ctx.reporter.stop()


def grpo_step(
    ctx: RunContext,
    rng: random.Random,
    generator: torch.Generator,
    sampling: SamplingParams,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None,
) -> dict:
    spec = ctx.job.spec
    grpo = spec.algorithm.grpo
    started = time.perf_counter()
    problems: list[Problem] = [
        ctx.task.train_problem(rng) for _ in range(spec.trainer.prompts_per_step)
    ]
    prompt_ids = [ctx.encode_prompt(p.prompt) for p in problems]
    completions = ctx.engine.generate(prompt_ids, grpo.group_size, sampling, generator)
    generated = time.perf_counter()

    texts = [ctx.decode(c.token_ids) for c in completions]
    answers = [problems[c.prompt_index].answer for c in completions]
    scores = ctx.rewards.score(texts, answers)
    rewards = torch.tensor(scores.total)
    advantages = group_relative_advantages(rewards, grpo.group_size, grpo.scale_rewards)
    batch = pack(
        [prompt_ids[c.prompt_index] for c in completions],
        [c.token_ids for c in completions],
        ctx.tokenizer.pad_token_id,
        [c.logprobs for c in completions],
        advantages.tolist(),
    )
    stats = train_on_batch(ctx, batch, optimizer, reference, sampling.temperature)
    ctx.engine.set_policy_version(ctx.engine.policy_version + 1)
    finished = time.perf_counter()
    exact = scores.per_term.get("exact_match")
    lengths = [len(c.token_ids) for c in completions]
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "train_accuracy": sum(exact) / len(exact) if exact else float("nan"),
        **stats,
        "response_len_mean": sum(lengths) / len(lengths),
        "truncated_fraction": sum(c.finish_reason == "length" for c in completions)
        / len(completions),
        "gen_time_s": generated - started,
        "train_time_s": finished - generated,
        "step_time_s": finished - started,
    }


def train_on_batch(
    ctx: RunContext,
    batch: SequenceBatch,
    optimizer: torch.optim.Optimizer,
    reference: torch.nn.Module | None,
    temperature: float,
) -> dict:
    """One optimizer step per PPO epoch; the loss is the batch's token mean however the
    batch is split into micro-batches."""
    grpo = ctx.job.spec.algorithm.grpo
    trainer = ctx.job.spec.trainer
    tokens = batch.tokens
    ctx.model.train()
    for _ in range(grpo.ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip": 0.0, "ratio": 0.0}
        for micro in _micro_batches(batch, trainer.micro_batch_size):
            logits = ctx.model(
                input_ids=micro.input_ids, attention_mask=micro.attention_mask
            ).logits
            logp = token_logprobs(logits, micro.targets, temperature)
            ref_logp = None
            if reference is not None:
                with torch.no_grad():
                    ref_logits = reference(
                        input_ids=micro.input_ids, attention_mask=micro.attention_mask
                    ).logits
                    ref_logp = token_logprobs(ref_logits, micro.targets, temperature)
            losses = grpo_token_losses(
                logp,
                micro.behaviour_logp,
                micro.advantages,
                grpo.clip_low,
                grpo.clip_high,
                ref_logp,
                grpo.kl_coef,
            )
            loss = token_mean(losses.loss, micro.mask, tokens)
            loss.backward()
            sums["loss"] += loss.item()
            sums["kl"] += masked_sum(losses.kl, micro.mask).item()
            sums["clip"] += masked_sum(losses.clipped, micro.mask).item()
            sums["ratio"] += masked_sum(losses.ratio, micro.mask).item()
            with torch.no_grad():
                sums["entropy"] += masked_sum(token_entropy(logits, temperature), micro.mask).item()
        grad_norm = torch.nn.utils.clip_grad_norm_(ctx.model.parameters(), trainer.grad_clip)
        optimizer.step()
    return {
        "loss": sums["loss"],
        "grad_norm": grad_norm.item(),
        "kl": sums["kl"] / tokens,
        "entropy": sums["entropy"] / tokens,
        "clip_fraction": sums["clip"] / tokens,
        "ratio_mean": sums["ratio"] / tokens,
        "tokens": tokens,
    }


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model)
    reference.eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference
