"""`rlft verify`: does this job's gradient depend on how the batch is split?

Runs the job's real model and algorithm on a small batch of real rollouts, once as a
single-process float64 reference (the whole batch in one micro-batch) and once on
`--world-size` torchrun ranks with FSDP2 and `--micro-batches` micro-batches per rank,
then compares the two gradients per parameter group. A correct trainer agrees to
rounding (~1e-12 in float64); a per-micro-batch normaliser or a dropped micro-batch
shows up as errors of order 1e-1.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from rlft.trainer.algorithms.batch import SequenceBatch, rank_shard
from rlft.trainer.algorithms.objectives import Models
from rlft.trainer.algorithms.registry import build_objective
from rlft.trainer.config import RLFineTune, dump_job, parse_job
from rlft.trainer.distributed import Dist
from rlft.trainer.learner.gradients import NO_FAULTS, Faults, backward, full_gradients, plan_step

WORKER = "rlft.trainer.verify.check"
FAULTS = {
    "none": NO_FAULTS,
    "per-micro-batch-normaliser": Faults(per_micro_batch_normaliser=True),
    "drop-micro-batch": Faults(drop_last_micro_batch=True),
}


def gradients(
    job: RLFineTune,
    models: Models,
    batch: SequenceBatch,
    micro_batches: int,
    dist: Dist,
    faults: Faults = NO_FAULTS,
) -> dict[str, torch.Tensor]:
    """The whole batch's gradient as trained: this rank's shard in `micro_batches` parts."""
    spec = job.spec
    sampling = spec.rollout.sampling
    objective = build_objective(spec.algorithm, sampling.temperature, sampling.max_new_tokens)
    unit = objective.unit
    shard = rank_shard(batch, dist.rank, dist.world, unit)
    units = max(1, math.ceil(len(shard) / unit / micro_batches))
    plan = plan_step(objective, models, shard, batch, units * unit, dist)
    backward(objective, models, plan, dist, faults)
    grads = full_gradients(models.policy)
    if models.critic is not None:
        grads |= {f"critic.{k}": v for k, v in full_gradients(models.critic).items()}
    return grads


_LAYER = re.compile(r"layers\.(\d+)\.([a-z_]+)")


def parameter_group(name: str) -> str:
    prefix = "critic " if name.startswith("critic.") else ""
    match = _LAYER.search(name)
    if match:
        return f"{prefix}layer {match.group(1)} {match.group(2)}"
    for key, label in (("embed", "embeddings"), ("norm", "final norm"), ("lm_head", "lm head")):
        if key in name:
            return prefix + label
    return prefix + ("value head" if prefix else name)


def compare(
    reference: dict[str, torch.Tensor], candidate: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Relative error ‖g − g_ref‖ / ‖g_ref‖ per parameter group."""
    if reference.keys() != candidate.keys():
        missing = sorted(reference.keys() ^ candidate.keys())[:5]
        raise ValueError(f"parameter names differ between runs: {missing}")
    diff: dict[str, float] = {}
    norm: dict[str, float] = {}
    for name, ref in reference.items():
        group = parameter_group(name)
        diff[group] = diff.get(group, 0.0) + float((candidate[name] - ref).square().sum())
        norm[group] = norm.get(group, 0.0) + float(ref.square().sum())
    return {
        g: (math.sqrt(diff[g]) / math.sqrt(norm[g])) if norm[g] > 0 else math.sqrt(diff[g])
        for g in diff
    }


# ------------------------------------------------------------------- the worker side


def _load_models(folder: Path, dist: Dist, job: RLFineTune) -> Models:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from rlft.trainer.distributed.fsdp import shard_model
    from rlft.trainer.model.build import to_float64
    from rlft.trainer.model.construct import from_pretrained

    parallelism = job.spec.trainer.parallelism
    policy = to_float64(from_pretrained(AutoModelForCausalLM, folder / "policy"))
    critic = None
    if (folder / "critic").is_dir():
        critic = to_float64(from_pretrained(AutoModelForTokenClassification, folder / "critic"))
        shard_model(critic, parallelism, dist)
    return Models(shard_model(policy, parallelism, dist), critic)


def worker_main(case_paths: list[str]) -> None:
    """Compute each case's gradient on this rank; rank 0 saves them."""
    from rlft.trainer.distributed.runtime import init_from_env, shutdown

    dist = init_from_env(timeout_s=300)
    for case_path in case_paths:
        case = json.loads(Path(case_path).read_text())
        torch.manual_seed(0)
        job = parse_job(case["job"])
        folder = Path(case["folder"])
        models = _load_models(folder, dist, job)
        batch = torch.load(folder / "batch.pt", weights_only=False)
        if case.get("pad_to"):
            batch = batch.padded_to(case["pad_to"], 0)
        faults = Faults(**case["faults"])
        grads = gradients(job, models, batch, case["micro_batches"], dist, faults)
        if dist.is_main:
            torch.save(grads, case["out"])
    shutdown()


def write_case(
    job: RLFineTune,
    folder: Path,
    micro_batches: int,
    faults: Faults = NO_FAULTS,
    pad_to: int | None = None,
    name: str = "candidate",
) -> Path:
    """A case file for the workers; they write the gradients to `folder/<name>.pt`."""
    case = {
        "job": dump_job(job),
        "folder": str(folder),
        "micro_batches": micro_batches,
        "faults": asdict(faults),
        "pad_to": pad_to,
        "out": str(folder / f"{name}.pt"),
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(case))
    return path


def run_cases(world_size: int, cases: list[Path]) -> list[dict[str, torch.Tensor]]:
    """Gradients from `world_size` torchrun ranks, one launch for all cases."""
    from rlft.trainer.distributed.launch import WorkersFailed, run_workers_captured

    try:
        run_workers_captured(world_size, WORKER, [str(c) for c in cases], timeout_s=900)
    except WorkersFailed as error:
        raise RuntimeError(f"the {world_size} verification workers failed: {error}") from None
    outs = [json.loads(c.read_text())["out"] for c in cases]
    return [torch.load(out, weights_only=False) for out in outs]


def local_gradients(
    job: RLFineTune, folder: Path, micro_batches: int = 1, pad_to: int | None = None
) -> dict[str, torch.Tensor]:
    """In this process (world size 1), float64; the reference with one micro-batch."""
    models = _load_models(folder, Dist(), job)
    batch = torch.load(folder / "batch.pt", weights_only=False)
    if pad_to:
        batch = batch.padded_to(pad_to, 0)
    return gradients(job, models, batch, micro_batches, Dist())


def prepare(job: RLFineTune, folder: Path, sequences: int) -> str:
    """Build the job's model(s) and a batch of real rollouts into `folder`; returns a note
    on how the batch was made."""
    from transformers.utils import logging as hf_logging

    from rlft.trainer.verify.batch import verification_batch

    hf_logging.disable_progress_bar()

    models, batch, note = verification_batch(job, sequences, random.Random(job.spec.trainer.seed))
    models.policy.save_pretrained(folder / "policy")
    if models.critic is not None:
        models.critic.save_pretrained(folder / "critic")
    torch.save(batch, folder / "batch.pt")
    return note


def verify(
    job: RLFineTune,
    world_size: int,
    micro_batches: int,
    tolerance: float,
    sequences: int,
    fault: str = "none",
    out=print,
) -> bool:
    with tempfile.TemporaryDirectory(prefix="rlft-verify-") as tmp:
        folder = Path(tmp)
        note = prepare(job, folder, sequences)
        out(f"rlft verify: {job.spec.algorithm.name}, {note}")
        reference = local_gradients(job, folder)
        case = write_case(job, folder, micro_batches, FAULTS[fault])
        (candidate,) = run_cases(world_size, [case])
    errors = compare(reference, candidate)
    out(
        f"relative gradient error, {world_size} rank(s) × {micro_batches} micro-batch(es) "
        f"vs 1 process × 1 micro-batch (float64), tolerance {tolerance:g}:"
    )
    width = max(len(g) for g in errors)
    for group, error in errors.items():
        flag = "" if error <= tolerance else "   <-- above tolerance"
        out(f"  {group:<{width}}  {error:.3e}{flag}")
    worst = max(errors, key=errors.get)
    ok = errors[worst] <= tolerance
    verdict = "PASS" if ok else "FAIL"
    out(f"{verdict}: worst {worst} {errors[worst]:.3e}")
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="verification worker (started by rlft verify)")
    parser.add_argument("cases", nargs="+")
    worker_main(parser.parse_args().cases)
    from rlft.trainer.distributed.runtime import exit_worker

    exit_worker(0)
