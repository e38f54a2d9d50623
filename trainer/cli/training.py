"""`rlft train` and `rlft verify`: the commands that run the trainer. Started by torchrun
(`--nproc N` here, or the operator's trainer pods), `rlft train` is one rank of the job."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NoReturn

from rlft.trainer import stop_while_starting, termination
from rlft.trainer.cli import entry
from rlft.trainer.cli.interrupts import InterruptedWhileStarting, deferred_interrupt
from rlft.trainer.config import RLFineTune
from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.redaction import finish_output, scrubbed
from rlft.trainer.telemetry import liveness

INTERRUPTED = entry.INTERRUPTED
"""`rlft train`'s exit code after a second Ctrl-C (the shell's for SIGINT): stopped at once,
without the emergency checkpoint the first one asks for."""

WORKER = "rlft.trainer.cli.main"
"""What `--nproc N` has torchrun start: `rlft train` itself, which joins the group."""


def _job(path: str) -> RLFineTune | None:
    from rlft.trainer.config import JobFileError, load_job

    try:
        return load_job(path)
    except JobFileError as error:
        _refused(*(f"{error.source}: {problem}" for problem in error.problems))
        return None


def _refused(*lines: str) -> int:
    """A job or command line `rlft train` refuses (exit 2), said on stderr and, in a rank
    torchrun started, in its verdict: torchrun exits 1 whatever its worker returned, and
    without one the operator retried a job no restart can run (a trainer image older
    than the operator that validated the spec, say)."""
    for line in lines:
        print(line, file=sys.stderr)
    if launched_by_torchrun():
        rank = int(os.environ["RANK"])
        liveness.report(termination.Verdict(ExitCode.INVALID_CONFIG, "; ".join(lines), rank))
    return ExitCode.INVALID_CONFIG


def _run(job: RLFineTune, args: argparse.Namespace, dist=None) -> int:
    # Imported here so that `rlft validate` works without the trainer's heavy extras; a
    # Ctrl-C meanwhile is raised after the imports, not inside torch's (interrupts.py).
    with deferred_interrupt():
        from rlft.trainer.checkpoint import BadUriError, CheckpointError, NoCheckpointError
        from rlft.trainer.checkpoint.errors import (
            ForeignCheckpointError,
            LocationTakenError,
            NewerFormatError,
        )
        from rlft.trainer.data.jsonl import DataFileError
        from rlft.trainer.data.rewards import RewardError
        from rlft.trainer.model.build import ModelLoadError
        from rlft.trainer.rollout.protocol import SupersededGangError
        from rlft.trainer.run.job import (
            OutputExistsError,
            StepFailedError,
            restarted_worker,
            run_job,
        )
        from rlft.trainer.storage.errors import StorageError
        from rlft.trainer.telemetry.server import TelemetryServeError

    rank = dist.rank if dist is not None else 0
    try:
        summary = run_job(
            job,
            _out(job, args),
            args.max_steps,
            args.overwrite,
            dist=dist,
            resume=args.resume,
            restarted=restarted_worker(_out(job, args)),
        )
    except (
        OutputExistsError,
        DataFileError,
        ModelLoadError,
        RewardError,
        ValueError,
        NoCheckpointError,
        NewerFormatError,  # upgrade rlft: a restart would refuse it again
        LocationTakenError,
        ForeignCheckpointError,  # another model's: a restart would meet it again
        BadUriError,
    ) as error:
        if isinstance(error, RewardError) and error.retryable:
            # A reward's own call out (a judge over the network) failed: a retry may
            # succeed, where a reward that is wrong would fail the same way again.
            return _failed(ExitCode.FAILURE, error, rank)
        return _failed(ExitCode.INVALID_CONFIG, error, rank)
    except (CheckpointError, StorageError, TelemetryServeError) as error:  # worth retrying
        return _failed(ExitCode.FAILURE, error, rank)
    except SupersededGangError as error:  # as the fence's SupersededError: this gang ends
        return _failed(ExitCode.FAILURE, error, rank)
    except StepFailedError as error:  # worth retrying too; where it came from is kept
        _print_traceback(error)
        return _failed(ExitCode.FAILURE, error, rank)
    code = summary.get("exit_code", ExitCode.OK)
    verdict = _verdict(job, summary, code, rank)
    # Judging ends first: a stall declared between the final write and the end wrote
    # over the verdict (now it is declared before, and the final verdict says it).
    liveness.current().end()
    liveness.report(verdict)
    if verdict.stopped and code == ExitCode.OK and _other_agents():
        # After its workers exit 0, torchrun's agent waits (up to 300 s, deaf to SIGTERM
        # inside a store call) in an exit barrier for every other agent, and an agent
        # stopped by SIGTERM never arrives there: the pod would hold its name and slot
        # until its grace runs out. Exiting non-zero ends the agent at once; the verdict
        # (exit code 0, stopped) is what the operator reads.
        if not summary.get("signalled", True):
            _await_own_agent(AGENT_NOTICE_SECONDS)
        return ExitCode.FAILURE
    return code


AGENT_NOTICE_SECONDS = 5.0
"""How long a rank stopped by a peer's SIGTERM waits for its own agent's (see below)."""


def _await_own_agent(seconds: float) -> None:
    """Wait up to `seconds` for this worker's own SIGTERM. When a node joins an elastic
    gang, each torchrun agent stops its workers when it next polls the rendezvous (up to
    about a second apart); the first worker stopped shares the stop with every rank, and
    a rank that exited before its agent noticed would read to that agent as a worker
    failure, ending the gang instead of growing it. A peer preempted alone sends no
    SIGTERM here: after the wait this rank exits as before."""
    import signal
    import time

    # A plain flag, polled: the handler runs on the main thread between bytecodes, and an
    # Event's set() there could wait forever on the lock its own wait() holds.
    arrived: list[bool] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: arrived.append(True))
    try:
        deadline = time.monotonic() + seconds
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _other_agents() -> bool:
    """Whether this rank's torchrun agent has peers (other pods of the gang)."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1


def _verdict(job: RLFineTune, summary: dict, code: int, rank: int) -> termination.Verdict:
    """What the pod reports: rank 0's summary (written once the outputs are published)
    says the job is complete, with its last step and checkpoint for the status mirror."""
    from rlft.trainer.checkpoint.manifest import step_dir

    last = summary.get("last_checkpoint_step")
    location = job.spec.checkpoint.uri
    uri = f"{location.rstrip('/')}/{step_dir(last)}" if location and last is not None else None
    return termination.Verdict(
        code,
        summary.get("ended", ""),
        rank,
        completed="steps" in summary,
        collapsed="ended" in summary,  # only the guard ends a run early (RunEnded)
        stopped="stopped_at_step" in summary,
        step=summary.get("steps"),
        last_checkpoint=last,
        checkpoint_uri=uri,
    )


def _print_traceback(error: BaseException) -> None:
    """The traceback on stderr, less the secrets it may quote (redaction.py)."""
    print(scrubbed("".join(traceback.format_exception(error))), end="", file=sys.stderr)


def _failed(code: int, error: BaseException, rank: int) -> int:
    """Report an error the trainer understands: on stderr, and as the pod's verdict."""
    print(f"rlft: {scrubbed(str(error))}", file=sys.stderr)
    liveness.report(termination.Verdict(code, str(error), rank))
    return code


def _out(job: RLFineTune, args: argparse.Namespace) -> Path:
    return Path(args.out) if args.out else Path("runs") / job.metadata.name


def cmd_train(args: argparse.Namespace) -> int:
    from rlft.trainer.allocator import fix_mmap_threshold

    fix_mmap_threshold()  # before the run allocates: see allocator.py
    if args.max_steps is not None and args.max_steps < 1:
        return _refused("rlft: --max-steps must be ≥ 1")
    job = _job(args.job)
    if job is None:
        return ExitCode.INVALID_CONFIG
    if args.nproc < 1:
        return _refused("rlft: --nproc must be ≥ 1")
    if args.overwrite and args.resume not in (None, "never"):
        # --overwrite deletes the run's checkpoints: there would be nothing to resume.
        return _refused(f"rlft: --resume {args.resume} with --overwrite: give one of them")
    if launched_by_torchrun():
        # A rank of a job whose ranks torchrun started (on Kubernetes: every worker of
        # every trainer pod): join the group it described, whatever --nproc says.
        return _run_as_rank(job, args)
    from rlft.trainer.distributed.launch import StoppedBeforeStart

    try:
        return _run(job, args) if args.nproc == 1 else _run_local_ranks(job, args)
    except StoppedBeforeStart as stop:
        print(f"rlft: stopped: {stop}; nothing had run", file=sys.stderr)
        return 128 + stop.signum  # the shell's code for a process a signal ended
    except InterruptedWhileStarting:
        print(entry.STOPPED_STARTING, file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:  # a second Ctrl-C (the first one checkpoints)
        print(
            "rlft: interrupted: the step in hand is lost; the newest committed "
            "checkpoint stays the one `rlft train` resumes from",
            file=sys.stderr,
        )
        return INTERRUPTED


def _run_local_ranks(job: RLFineTune, args: argparse.Namespace) -> int:
    """`rlft train --nproc N`: torchrun starts N ranks of this command on this machine."""
    from rlft.trainer.distributed.launch import run_workers

    out = _out(job, args)
    forwarded = ["train", args.job, "--out", str(out)]
    if args.resume is not None:
        forwarded += ["--resume", str(args.resume)]
    if args.max_steps is not None:
        forwarded += ["--max-steps", str(args.max_steps)]
    if args.overwrite:
        forwarded.append("--overwrite")
    with tempfile.TemporaryDirectory(prefix="rlft-verdicts-") as folder:
        # The ranks' verdicts: torchrun's agent exits 1 whatever its workers returned.
        log = os.environ.get(termination.ENV) or str(Path(folder) / "termination-log")
        code = run_workers(
            args.nproc,
            WORKER,
            forwarded,
            env={termination.ENV: log},
            grace_s=job.spec.checkpoint.grace_period_seconds,
        )
        written = Path(log).read_text() if Path(log).is_file() else ""
    return ranks_exit_code(code, termination.read(written))


def ranks_exit_code(agent_code: int, verdict: termination.Verdict | None) -> int:
    """`rlft train --nproc`'s exit code: the ranks' own (2 for a bad job, 3 for a
    collapse, 0 for a stop that checkpointed), not the agent's 1 for any of them."""
    if agent_code == 0:
        return ExitCode.OK
    if verdict is None or (verdict.exit_code == ExitCode.OK and not verdict.stopped):
        return ExitCode.FAILURE  # a rank died without a word (killed), whatever others said
    return verdict.exit_code


def launched_by_torchrun(environ: dict[str, str] | None = None) -> bool:
    """torchrun (the elastic agent) sets these for each worker it starts."""
    environ = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ and "WORLD_SIZE" in environ


def _run_as_rank(job: RLFineTune, args: argparse.Namespace) -> int:
    from rlft.trainer.telemetry import liveness_server

    rank = int(os.environ["RANK"])
    termination.forget_earlier_generations()  # a worker restarted in place starts clean
    # Until the training loop's own handler (GracefulStop) takes SIGTERM over: importing
    # torch, joining the group, building the model. Nothing to checkpoint there.
    stop_while_starting.StopWhileStarting(
        lambda: _stopped_while_starting(rank), lambda: _stopped_while_ending(rank)
    ).install()
    # First, before torch is even imported: the pod's probes ask from the moment its
    # worker runs, and a worker restarted in place must answer again within seconds.
    try:
        liveness_server.start(job.spec.trainer.stall_timeout_seconds, rank)
    except OSError as error:
        return _failed(ExitCode.FAILURE, error, rank)
    from rlft.trainer.distributed.runtime import exit_worker, init_from_env, shutdown

    try:
        dist = init_from_env(collective_timeout_s(job))
    except Exception as error:  # the store unreachable, a peer that never came
        _print_traceback(error)
        liveness.report(join_failure(error, rank))
        exit_worker(ExitCode.FAILURE)
    liveness.beat("joined the process group")
    print(f"rlft: rank {dist.rank} of world size {dist.world}", flush=True)
    try:
        code = _run(job, args, dist)
    except KeyboardInterrupt:
        # `rlft train --nproc` passed on a second Ctrl-C: stop now, without a traceback
        # per rank; `rlft train` says what it means once.
        exit_worker(INTERRUPTED)
    except BaseException as error:
        # No goodbye barrier: the other ranks may be waiting in a collective this rank
        # will never join. Ending the process breaks their connections, and torchrun
        # stops the group with the failure.
        _print_traceback(error)
        message = f"{type(error).__name__}: {error}"
        liveness.report(termination.Verdict(ExitCode.FAILURE, message, dist.rank))
        _verdict_written()
        exit_worker(ExitCode.FAILURE)
    # The verdict is written: a peer gone from the goodbye barrier changes nothing of it
    # (its error escaped here, and the agent stopped rank 0 mid-publication).
    _verdict_written()
    with contextlib.suppress(Exception):
        shutdown()
    exit_worker(code)


def join_failure(error: BaseException, rank: int) -> termination.Verdict:
    """The verdict of a rank that could not join its process group. Worth a retry (the
    next attempt's rendezvous may succeed); the error's type stays in the message, where
    the operator tells a rendezvous failure by it (a DistStoreError: a peer never came)."""
    message = f"could not join the process group: {type(error).__name__}: {error}"
    return termination.Verdict(ExitCode.FAILURE, message, rank)


STOPPED_WHILE_STARTING = (
    "stopped while starting (SIGTERM before training began): nothing had run, so nothing "
    "is lost; a restart resumes from the newest committed checkpoint, if any"
)


def _stopped_while_starting(rank: int) -> NoReturn:
    """End a rank SIGTERM reached before training began (on StopWhileStarting's thread,
    while the main thread may be anywhere), with a retryable failure that says so. Not a
    stop (exit 0, `stopped`): torchrun sends its other workers SIGTERM when one dies, and
    a killed rank writes no verdict, so their "stopped" would be read as the gang's and
    hide the death (`rlft train --nproc` exited 0 with a rank SIGKILLed). The operator
    tells a pod it deleted or one preempted from the pod, not from this verdict."""
    print(f"rlft: {STOPPED_WHILE_STARTING}", file=sys.stderr, flush=True)
    liveness.report(termination.Verdict(ExitCode.FAILURE, STOPPED_WHILE_STARTING, rank))
    finish_output()
    sys.stdout.flush()
    # Not exit_worker: its module imports torch, which the main thread may be importing.
    os._exit(ExitCode.FAILURE)


def _verdict_written() -> None:
    """A SIGTERM from now on ends the rank at once (the default action): its verdict is
    written, and where it waits in a C call (the goodbye barrier, NCCL's teardown) the
    late handler, a Python one, would not even run until torchrun's SIGKILL."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stopped_while_ending(rank: int) -> NoReturn:
    """A SIGTERM after the run, and the rank had not ended on its own since (on a timer's
    thread): a retryable failure, unless the rank had written its verdict already."""
    message = "stopped (SIGTERM) while ending, before it had written its verdict"
    liveness.report_unless_written(termination.Verdict(ExitCode.FAILURE, message, rank))
    finish_output()
    sys.stdout.flush()
    os._exit(ExitCode.FAILURE)


def collective_timeout_s(job: RLFineTune) -> float:
    """The process group's timeout: past every phase in which the other ranks wait in a
    collective for rank 0's own work (reaching the rollout pods, publishing the outputs
    through a store outage, a stalled rank's own timeout), so that liveness judges those
    waits rather than a timeout that ended a finished job as a failure."""
    from rlft.trainer.rollout.session import pods_start_within

    spec = job.spec
    longest = max(
        pods_start_within(job),
        spec.checkpoint.upload_retry_minutes * 60,
        spec.trainer.stall_timeout_seconds,
    )
    return max(600.0, longest + 300.0)


def _which(value: str) -> str | int:
    if value in ("auto", "latest-healthy", "never"):
        return value
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError("use auto, latest-healthy, never or a step number")


def cmd_verify(args: argparse.Namespace) -> int:
    job = _job(args.job)
    if job is None:
        return ExitCode.INVALID_CONFIG
    for name in ("world_size", "micro_batches", "sequences"):
        if getattr(args, name) < 1:
            print(f"rlft: --{name.replace('_', '-')} must be ≥ 1", file=sys.stderr)
            return ExitCode.INVALID_CONFIG
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        # A negative or NaN tolerance failed every layer, an infinite one passed any: each
        # after the whole comparison, as a verdict on the gradient rather than on the flag.
        print("rlft: --tolerance must be a finite number ≥ 0", file=sys.stderr)
        return ExitCode.INVALID_CONFIG
    from rlft.trainer.verify.check import verify

    try:
        ok = verify(
            job, args.world_size, args.micro_batches, args.tolerance, args.sequences, args.fault
        )
    except ValueError as error:
        print(f"rlft verify: {error}", file=sys.stderr)
        return ExitCode.INVALID_CONFIG
    return ExitCode.OK if ok else ExitCode.FAILURE


def add_training_commands(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="run a job on this machine")
    train.add_argument("job", help="RLFineTune manifest (YAML)")
    train.add_argument("--out", help="output folder (default runs/<metadata.name>)")
    train.add_argument("--max-steps", type=int, help="stop after this many steps")
    train.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a run already in the output folder and start afresh, "
        "abandoning the checkpoints at spec.checkpoint.uri too (its commits replace them)",
    )
    train.add_argument(
        "--nproc", type=int, default=1, help="train on this many local ranks (torchrun, FSDP2)"
    )
    train.add_argument(
        "--resume",
        type=_which,
        help="auto (continue from the newest checkpoint if any), latest-healthy, never, or "
        "a step number (default: the job's spec.checkpoint.resume, itself auto by default)",
    )
    train.set_defaults(handler=cmd_train)

    verify = commands.add_parser(
        "verify",
        help="check that the job's gradient does not depend on micro-batching or world size",
    )
    verify.add_argument("job", help="RLFineTune manifest (YAML)")
    verify.add_argument("--world-size", type=int, default=2, help="ranks to compare (default 2)")
    verify.add_argument(
        "--micro-batches", type=int, default=4, help="micro-batches per rank (default 4)"
    )
    verify.add_argument("--sequences", type=int, default=32, help="batch size (default 32)")
    verify.add_argument(
        "--tolerance", type=float, default=1e-6, help="largest relative error (default 1e-6)"
    )
    verify.add_argument(
        "--inject-fault",
        dest="fault",
        default="none",
        choices=["none", "per-micro-batch-normaliser", "drop-micro-batch"],
        help=argparse.SUPPRESS,  # plants a known bug to show that verify catches it
    )
    verify.set_defaults(handler=cmd_verify)
