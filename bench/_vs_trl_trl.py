"""TRL's side of bench/vs_trl.py: GRPOTrainer on the shared warm start for a wall-clock
budget. Runs in TRL's own environment (torch, transformers, trl, datasets; no rlft):

    .venv-trl/bin/python bench/_vs_trl_trl.py INPUT.json OUT_DIR

INPUT.json holds the model folder, the budget, the recipe and the training problems
(prompt/answer pairs). Writes OUT_DIR/result.json (per-step generation and wall seconds,
snapshot steps and times) and OUT_DIR/snapshot-K.pt (state_dict copies at the marks).

Timing: `_generate_and_score_completions` (tokenising, `model.generate`, decoding,
rewards, advantages) is generation; the rest of the gap between two `on_step_end`s is
training. The clock starts at the first `on_step_begin`; snapshot copies are taken off it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def exact_match(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion is the answer, up to whitespace (rlft's `exact_match`)."""
    return [
        float(" ".join(c.split()) == " ".join(a.split()))
        for c, a in zip(completions, answer, strict=True)
    ]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up the time spent making each step's scored completions."""

    generation_s = 0.0

    def _generate_and_score_completions(self, inputs):
        started = time.perf_counter()
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.generation_s += time.perf_counter() - started


class Clock(TrainerCallback):
    """Per-step times, snapshots at the marks (off the clock), stop at the budget."""

    def __init__(self, seconds: float, marks: list[float]):
        self.seconds = seconds
        self.marks = [m for m in marks if m > 0]
        self.trainer: TimedGRPOTrainer | None = None
        self.started: float | None = None
        self.excluded = 0.0
        self.last = 0.0
        self.last_generation = 0.0
        self.gen: list[float] = []
        self.wall: list[float] = []
        self.snapshots: list[tuple[float, float, int, dict]] = []

    def elapsed(self) -> float:
        assert self.started is not None
        return time.perf_counter() - self.started - self.excluded

    def on_step_begin(self, args, state, control, **kwargs):
        if self.started is None:
            self.started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = self.elapsed()
        assert self.trainer is not None
        self.gen.append(self.trainer.generation_s - self.last_generation)
        self.last_generation = self.trainer.generation_s
        self.wall.append(now - self.last)
        self.last = now
        while self.marks and now >= self.marks[0] * self.seconds:
            copied = time.perf_counter()
            state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.snapshots.append((self.marks.pop(0), now, state.global_step, state_dict))
            self.excluded += time.perf_counter() - copied
        if now >= self.seconds:
            control.should_training_stop = True
        return control


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    recipe = spec["recipe"]
    torch.set_num_threads(recipe["threads"])
    torch.manual_seed(recipe["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True)
    sample = spec["problems"][0]["prompt"]
    if tokenizer(sample)["input_ids"] != tokenizer(sample, add_special_tokens=False)["input_ids"]:
        raise SystemExit("TRL's prompt tokens would differ from rlft's (special tokens added)")
    # Stop where rlft and the bare loop stop (end-of-text and end-of-turn): GRPOTrainer stops
    # on the model's generation_config.eos_token_id, which is end-of-text alone.
    model.generation_config.eos_token_id = spec["stop_ids"]
    dataset = Dataset.from_list(spec["problems"])
    batch = recipe["prompts"] * recipe["group"]
    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=recipe["seed"],
        data_seed=recipe["seed"],
        per_device_train_batch_size=batch,  # sequences per micro-batch: the whole step
        gradient_accumulation_steps=1,
        num_generations=recipe["group"],
        generation_batch_size=batch,  # one generation batch = one optimizer step
        num_iterations=1,
        max_steps=1_000_000,  # the callback stops at the budget
        max_completion_length=recipe["max_new_tokens"],
        temperature=recipe["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=recipe["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=recipe["grad_clip"],
        beta=0.0,
        epsilon=recipe["clip"],
        epsilon_high=recipe["clip"],
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        gradient_checkpointing=False,
        disable_dropout=True,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    clock = Clock(spec["seconds"], spec["marks"])
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[exact_match],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    if sorted(trainer.eos_token_ids) != sorted(spec["stop_ids"]):
        raise SystemExit(f"TRL stops on {trainer.eos_token_ids}, rlft on {spec['stop_ids']}")
    clock.trainer = trainer
    trainer.train()
    snapshots = []
    for k, (mark, wall, step, state_dict) in enumerate(clock.snapshots):
        path = out / f"snapshot-{k}.pt"
        torch.save(state_dict, path)
        snapshots.append({"mark": mark, "wall_s": wall, "step": step, "path": str(path)})
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {
        "gen": clock.gen,
        "wall": clock.wall,
        "snapshots": snapshots,
        "reward_first": rewards[:5],
        "reward_last": rewards[-5:],
        "versions": {
            "trl": __import__("trl").__version__,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        },
        "config": {k: getattr(config, k) for k in ("loss_type", "scale_rewards", "top_k", "beta")},
    }
    (out / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
