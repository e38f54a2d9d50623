"""`rlft train`: a whole job, in one process or on torchrun ranks: optional SFT warm
start, the job's algorithm, held-out evaluation, export.

Rank 0 owns the rollout engine, the rewards and every file written; all ranks train
(FSDP2 when there are several) and hold the frozen reference.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import yaml

from rlft.trainer.checkpoint import storage_from_spec
from rlft.trainer.checkpoint.manifest import OUTPUTS
from rlft.trainer.config import RLFineTune, dump_job
from rlft.trainer.distributed import Dist
from rlft.trainer.distributed.runtime import leave_peers
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.learner.learner import Learner
from rlft.trainer.model.build import count_parameters
from rlft.trainer.rollout import TransformersEngine
from rlft.trainer.rollout.session import local_engine_problem
from rlft.trainer.run.checkpointing import Checkpointing, StopRequested
from rlft.trainer.run.loop import MainRank, Run, train
from rlft.trainer.run.parts import JobParts, build_parts
from rlft.trainer.run.phases import (
    main_phase,
    prepare_main_phase,
    wants_warm_start,
    warm_start_phase,
)
from rlft.trainer.run.progress import Reporter
from rlft.trainer.run.state import Cursor
from rlft.trainer.run.supervisor import RunEnded, Supervisor
from rlft.trainer.storage.backends import TEMP_MARK
from rlft.trainer.storage.retry import with_retries
from rlft.trainer.telemetry import liveness

RUN_ID_FILE = ".rlft-run-id"
"""The torchrun rendezvous whose workers wrote the folder (on Kubernetes, the job's
gang). torchrun restarts a gang's workers when a node joins or leaves without counting
it (TORCHELASTIC_RESTART_COUNT stays 0): a worker of the same rendezvous finding files
there is that restart, not a second run to protect them from."""
RUN_FILES = ("metrics.jsonl", "summary.json", "model", "job.yaml", RUN_ID_FILE)


def restarted_worker(out: Path) -> bool:
    """Whether this process is a torchrun restart of the run that wrote `out`."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return True
    run_id, marker = os.environ.get("TORCHELASTIC_RUN_ID"), out / RUN_ID_FILE
    return bool(run_id) and marker.is_file() and marker.read_text().strip() == run_id


class OutputExistsError(Exception):
    """The output folder already holds a run that would be overwritten."""


def existing_run_files(out: Path) -> list[str]:
    """What of a run `out` holds. Only results count: a run stopped in its warm start or
    its first step (or refused) leaves its job.yaml, an empty metrics.jsonl and an empty
    checkpoints/, and running the same command again must start it again, not refuse it."""
    bookkeeping = ("job.yaml", RUN_ID_FILE)  # what a start writes before any result
    results = [n for n in RUN_FILES if n not in bookkeeping and _holds_something(out / n)]
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and any(
        not entry.name.startswith(TEMP_MARK) for entry in checkpoints.iterdir()
    ):  # a save's staging folder alone is no checkpoint
        results.append("checkpoints")
    if results:  # replaced with them
        results += [n for n in bookkeeping if (out / n).exists()]
    return results


def _holds_something(path: Path) -> bool:
    """A folder, or a file with content (metrics.jsonl is opened before the first step)."""
    return path.is_dir() or (path.is_file() and path.stat().st_size > 0)


def prepare_output(
    out: Path, overwrite: bool, never: bool = False, why: str = "no checkpoint to resume"
) -> None:
    """Refuse to clobber a run (unless `overwrite`, which removes it, local checkpoints
    included); create the folder. `never`: the run was told not to resume (it may have
    checkpoints to resume from: the error says how); else `why` it starts afresh."""
    existing = existing_run_files(out)
    if existing and not overwrite:
        why = "this run does not resume (resume: never)" if never else why
        raise OutputExistsError(
            f"{out} already holds a run ({', '.join(existing)}) and {why}; choose another "
            f"--out or pass --overwrite to replace it{' (or resume it)' if never else ''}"
        )
    try:
        for name in existing:
            target = out / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputExistsError(
            f"--out {out}: {error.strerror or error}"
            f"{f' ({error.filename})' if error.filename else ''}: choose a folder rlft can "
            "create and write"
        ) from None


class StepFailedError(RuntimeError):
    """A ValueError raised after the run trained a step (in a later step, or once the
    steps are done): not the job's configuration."""


def run_job(
    job: RLFineTune,
    out: Path,
    max_steps: int | None = None,
    overwrite: bool = False,
    reporter: Reporter | None = None,
    dist: Dist | None = None,
    resume: str | int | None = None,
    restarted: bool = False,
) -> dict:
    """Run the whole job; rank 0 writes metrics.jsonl, summary.json and model/ to `out`.

    `resume` (default `spec.checkpoint.resume`): `auto` continues from the newest
    checkpoint when there is one, `latest-healthy` from the newest healthy one, a step
    number from that step, `never` starts afresh. `overwrite` starts afresh too, after
    removing the previous run's files and local checkpoints.

    A restart (`restarted`: torchrun started this worker again; or the operator's
    restarts, which say `latest-healthy`) that finds no checkpoint starts the job again
    over the files its earlier attempt left in `out`, instead of refusing to clobber them.
    """
    try:
        return _run_job(job, out, max_steps, overwrite, reporter, dist, resume, restarted)
    except BaseException:
        # An error of this rank's own (a step that failed on it alone, rank 0's output
        # folder): its peers may wait for it in a collective, not in the goodbye barrier.
        leave_peers()
        raise


def _run_job(
    job: RLFineTune,
    out: Path,
    max_steps: int | None,
    overwrite: bool,
    reporter: Reporter | None,
    dist: Dist | None,
    resume: str | int | None,
    restarted: bool,
) -> dict:
    dist = dist or Dist()
    reporter = _reporter_for(dist, reporter)
    started = time.perf_counter()
    # Everything that can reject the job (data, rewards, model, output folder) runs
    # before anything is written, so a bad job leaves no half-made output behind.
    parts = build_parts(job)
    problem = local_engine_problem(job.spec.rollout, parts.policy.config.to_dict())
    if problem:
        raise ValueError(problem)
    liveness.beat("built the model, tokenizer and data")
    resume = "never" if overwrite else (resume or job.spec.checkpoint.resume)
    existing = dist.broadcast(existing_run_files(out) if dist.is_main else None)
    if dist.is_main and (overwrite or not existing):
        prepare_output(out, overwrite)
    dist.barrier()
    run = _assemble(job, out, parts, dist, reporter)
    liveness.beat("sharded the model")
    try:
        if not overwrite:
            resume = run.checkpoints.choice(resume)
        if resume == "never" or not _resume(run, parts, resume):
            if existing and not overwrite:
                # Rank 0's view decides for every rank (each may have other arguments).
                # A user's own --resume latest-healthy is no restart: the folder's run is
                # refused as any other (it deleted it, local checkpoints included).
                operator = run.checkpoints.operator_run and resume == "latest-healthy"
                again = dist.broadcast(restarted or operator)
                if not again:
                    why = run.checkpoints.fresh_because or "no checkpoint to resume"
                    prepare_output(out, False, never=resume == "never", why=why)  # raises
                elif dist.is_main:
                    prepare_output(out, overwrite=True)
            _announce(run, parts, resumed=False)
            _start_main_phase(run, parts.policy.config)
        spec = job.spec
        steps = min(spec.trainer.steps, max_steps) if max_steps is not None else spec.trainer.steps
        phase = main_phase(run, steps)
        with (out / "metrics.jsonl").open("a") if dist.is_main else nullcontext() as metrics:
            if run.main is not None:
                run.main.metrics = metrics
            trained_before = run.cursor.step
            try:
                train(run, phase)
            except ValueError as error:
                if run.cursor.step == trained_before == 0:
                    raise  # the run's first step: may be the job's (e.g. its data), exit 2
                # The job trained a step (in this process or before its resume), so its
                # configuration is not the cause: a bug or a fault, worth a restart from
                # the checkpoint (exit 1, traceback kept), not a permanent failure with
                # the message alone. Judged by this process alone, a failure that exited
                # 1 became exit 2 on the restart that resumed before it.
                raise StepFailedError(f"step {run.cursor.step + 1} failed: {error}") from error
        try:
            run.checkpoints.final(run.cursor, run.learner)
            extra = phase.source.summary(run)
            # Still inside: a SIGTERM while the final model is evaluated and written
            # (minutes on a real job) is a stop in its grace, not the signal's default
            # end, which killed the process there without a verdict.
            eval_final = run.eval_accuracy()
            if not dist.is_main:
                return {}
            return _finish(run, parts, steps, extra, eval_final, time.perf_counter() - started)
        except ValueError as error:
            if run.cursor.step == 0:
                raise
            # As for a step: a job that trained is configured well enough (this was exit
            # 2, a permanent failure blamed on the job, for an error in its final save).
            raise StepFailedError(f"after step {run.cursor.step}: {error}") from error
    except StopRequested as stop:
        reporter.log(f"rlft: {stop}; exiting so the job can resume later")
        # `signalled`: this process's own SIGTERM, not only a peer's shared by the loop.
        signalled = run.checkpoints.stop.requested
        return {
            "stopped_at_step": stop.step,
            "exit_code": ExitCode.OK,
            "signalled": signalled,
            # The emergency checkpoint, named in the termination message: the operator's
            # sign that the job has a checkpoint of its own.
            "last_checkpoint_step": run.checkpoints.last_step,
        }
    except RunEnded as ended:
        reporter.log(f"rlft: {ended}")
        return {"ended": str(ended), "exit_code": ended.code}
    finally:
        run.checkpoints.close()
        run.supervisor.close()


def _reporter_for(dist: Dist, reporter: Reporter | None) -> Reporter:
    reporter = reporter or (Reporter() if dist.is_main else Reporter(interactive=False))
    if not dist.is_main:
        reporter.log = lambda message: None  # type: ignore[method-assign]
        reporter.advance = lambda done, info: None  # type: ignore[method-assign]
    return reporter


def _assemble(job: RLFineTune, out: Path, parts: JobParts, dist: Dist, reporter) -> Run:
    learner = Learner(parts.policy, job.spec.trainer, dist)
    main = None
    if dist.is_main:
        engine = TransformersEngine(learner.engine_model, parts.encoder.pad_id, parts.stop_ids)
        main = MainRank(engine, parts.rewards)
    supervisor = Supervisor(job, dist, reporter.log)
    checkpoints = Checkpointing(job, out, dist, learner.engine_model, parts.tokenizer, supervisor)
    cursor = Cursor(job.spec.trainer.seed)
    return Run(
        job, parts.task, parts.encoder, learner, dist, reporter, supervisor, checkpoints, cursor,
        out, main,
    )  # fmt: skip


def _resume(run: Run, parts: JobParts, which: str | int) -> bool:
    """Restore the checkpoint `which` selects into the run; False when there is none."""
    prepare_main_phase(run, parts.policy.config)  # the shapes a checkpoint restores into
    resumed = run.checkpoints.resume(which, run.learner)
    liveness.beat("looked for a checkpoint to resume from")
    if resumed is None:
        return False
    run.cursor = resumed
    run.set_policy_version(resumed.policy_version)
    _announce(run, parts, resumed=True)
    return True


def _finish(
    run: Run, parts: JobParts, steps: int, extra: dict, eval_final: float, seconds: float
) -> dict:
    """Rank 0: the final model and summary.json."""
    spec, out, cursor = run.spec, run.out, run.cursor
    run.learner.engine_model.save_pretrained(out / "model", safe_serialization=True)
    parts.tokenizer.save_pretrained(out / "model")
    eval_start = cursor.results["eval_accuracy_start"]
    summary = {
        "job": run.job.metadata.name,
        "algorithm": spec.algorithm.name,
        "world_size": run.dist.world,
        # The step reached: a resume past --max-steps trains none, and said the cap.
        "steps": max(steps, cursor.step),
        "sft_steps": cursor.sft_steps,
        "policy_version": cursor.policy_version,
        "eval_problems": len(parts.task.eval_problems()[: spec.eval.max_problems]),
        "eval_accuracy_sft": eval_start,
        "eval_accuracy_final": eval_final,
        "eval_accuracy_gain": eval_final - eval_start,
        **extra,
        "parameters": count_parameters(run.learner.engine_model),
        "seed": spec.trainer.seed,
        "last_checkpoint_step": run.checkpoints.last_step,
        "wall_time_s": round(seconds, 2),
    }
    outputs = outputs_uri(spec.checkpoint.uri)
    if outputs is not None:
        summary["outputs_uri"] = outputs
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if outputs is not None:
        _publish_outputs(run)
        run.reporter.log(f"rlft: model, metrics.jsonl and summary.json copied to {outputs}")
    run.reporter.log(
        f"rlft: held-out accuracy {eval_start:.3f} → {eval_final:.3f} after {steps} "
        f"{spec.algorithm.name} steps ({summary['wall_time_s']:.0f} s); "
        f"model saved to {out / 'model'}"
    )
    return summary


def outputs_uri(checkpoint_uri: str | None) -> str | None:
    """Where a run with a checkpoint location keeps what outlives it (on Kubernetes the
    pods' own folders do not): `<spec.checkpoint.uri>/outputs`."""
    return None if checkpoint_uri is None else f"{checkpoint_uri.rstrip('/')}/{OUTPUTS}"


def _publish_outputs(run: Run) -> None:
    """Rank 0: the final model (Hugging Face folder), metrics.jsonl and summary.json
    under the checkpoint location, the summary last (its presence says the rest is there).
    An earlier run's outputs there are replaced whole: its summary is withdrawn, then its
    model, before anything is uploaded, so an export never takes a mix of two runs'
    models (without a summary it takes the latest checkpoint)."""
    storage = storage_from_spec(run.spec.checkpoint, run.out / "checkpoints")
    model = run.out / "model"
    files = [
        (f"{OUTPUTS}/model/{path.relative_to(model).as_posix()}", path)
        for path in sorted(p for p in model.rglob("*") if p.is_file())
    ] + [(f"{OUTPUTS}/metrics.jsonl", run.out / "metrics.jsonl")]
    # Retried through a store outage as checkpoint uploads are: the run is done by now.
    deadline = time.monotonic() + run.spec.checkpoint.upload_retry_minutes * 60

    def retried(what: str, call: Callable[[], object]) -> None:
        liveness.beat(f"publishing {what}")
        with_retries(call, deadline_s=max(0.0, deadline - time.monotonic()), cap=10.0)

    summary = f"{OUTPUTS}/summary.json"
    retried(summary, lambda: storage.delete_prefix(summary))
    retried(f"{OUTPUTS}/model/", lambda: storage.delete_prefix(f"{OUTPUTS}/model/"))
    for key, path in files:
        retried(key, lambda key=key, path=path: storage.put_file(key, path))
    retried(summary, lambda: storage.put_file(summary, run.out / "summary.json"))


def _announce(run: Run, parts: JobParts, resumed: bool) -> None:
    if not run.dist.is_main:
        return
    tokenizer = parts.tokenizer
    spec, model = run.spec, run.learner.engine_model
    (run.out / "job.yaml").write_text(yaml.safe_dump(dump_job(run.job), sort_keys=False))
    if run_id := os.environ.get("TORCHELASTIC_RUN_ID"):
        (run.out / RUN_ID_FILE).write_text(run_id + "\n")
    ranks = f", {run.dist.world} ranks (FSDP2)" if run.dist.active else ""
    run.reporter.log(
        f"rlft: job {run.job.metadata.name}: {count_parameters(model) / 1e6:.2f}M-parameter "
        f"{type(model).__name__}, vocabulary {len(tokenizer)}, {spec.algorithm.name}{ranks}, "
        f"output {run.out}"
    )
    if resumed:
        run.reporter.log(
            f"rlft: resumed from the checkpoint of step {run.cursor.step} "
            f"({run.checkpoints.checkpointer.storage.uri})"
        )


def _start_main_phase(run: Run, config) -> None:
    """A fresh start: the warm start (when the job has one), the held-out accuracy it
    reached, and the main phase's optimizer, reference and critic."""
    spec = run.spec
    if wants_warm_start(run):
        run.cursor.sft_steps = train(run, warm_start_phase(run))
    eval_start = run.eval_accuracy()
    run.reporter.log(f"rlft: held-out accuracy before {spec.algorithm.name}: {eval_start:.3f}")
    prepare_main_phase(run, config)
    liveness.beat("prepared the main phase")
    run.cursor.results["eval_accuracy_start"] = eval_start
