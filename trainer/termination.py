"""The verdict a trainer or rollout process leaves in its container's termination message.

The exit code alone does not reach the operator: torchrun's agent exits 1 whichever code
its worker returned, and a pod's log tail is no place to look for facts (nor to copy into
a status anyone may read). So each process that ends with a verdict writes one JSON line
per rank to `$RLFT_TERMINATION_LOG` (the operator sets it to the container's
`terminationMessagePath`), and the operator's failure policy reads it back from the
container status: the trainer's own exit code and message, and whether rank 0 finished
the job, with the last step and checkpoint for the status mirror.

No torch here: the operator imports this module.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from dataclasses import asdict, dataclass

from rlft.trainer.exit_codes import ExitCode
from rlft.trainer.redaction import scrubbed

ENV = "RLFT_TERMINATION_LOG"
MARK = "rlftVerdict"
MAX_MESSAGE = 600
"""Characters of one rank's message, at most."""
MAX_BYTES = 4096
"""What the kubelet keeps of a termination message: its last 4096 bytes. All ranks'
lines must fit (a pod runs gpusPerPod ranks), or the first-written verdicts are lost."""

# Which verdict a pod with several ranks shows: the most telling one first.
_SEVERITY = {
    ExitCode.INVALID_CONFIG: 0,
    ExitCode.COLLAPSED: 1,
    ExitCode.FAILURE: 2,
    ExitCode.OK: 3,
}


@dataclass(frozen=True)
class Verdict:
    exit_code: int
    message: str = ""
    """The process's own words (an error it raised), never its log."""
    rank: int = 0
    completed: bool = False
    """Rank 0 finished the whole job (outputs published)."""
    collapsed: bool = False
    """The trainer ended the run over a collapse: failing it (exit 3) or pausing it
    (exit 0, stability.onCollapse or afterMaxRollbacks is suspend)."""
    stopped: bool = False
    """The rank stopped after an emergency checkpoint (SIGTERM): resume from it. Its
    process may still exit non-zero (see `training.py`): this is what counts."""
    stalled: bool = False
    """The rank made no progress for spec.trainer.stallTimeoutSeconds: written by its
    liveness watch when it stops answering 200 (it cannot write anything once it is
    killed), kept on any later verdict of the same process, removed if it recovers."""
    step: int | None = None
    last_checkpoint: int | None = None
    """Step of the last committed checkpoint, at `checkpoint_uri`."""
    checkpoint_uri: str | None = None


STARTED = time.time()
"""When this process began (the module is imported at a worker's start)."""
GENERATION_GAP_S = 5.0
"""A line whose writer started this much before this process is another generation's."""


_written = False
_writing = threading.RLock()


def write(verdict: Verdict, environ: dict[str, str] | None = None) -> None:
    """Record `verdict` as this rank's line, replacing an earlier one of the same rank
    (an in-pod restart); other ranks' lines are kept. Best effort: never raises."""
    global _written
    line = {**_parse_lines(encode(verdict))[0], "started": round(STARTED, 3)}
    with _writing:
        _edit(lambda lines: [v for v in lines if v.get("rank") != verdict.rank] + [line], environ)
        _written = True


def write_unless_written(verdict: Verdict, environ: dict[str, str] | None = None) -> None:
    """`write`, unless this process wrote its rank's verdict already (one from a thread
    that ends the process never replaces the main thread's own)."""
    with _writing:
        if not _written:
            write(verdict, environ)


def clear(rank: int, environ: dict[str, str] | None = None) -> None:
    """Remove this rank's line (a stall it recovered from); best effort, never raises."""
    global _written
    with _writing:
        _edit(lambda lines: [v for v in lines if v.get("rank") != rank], environ)
        _written = False


def forget_earlier_generations(environ: dict[str, str] | None = None) -> None:
    """At a worker's start, drop the lines of workers that started well before it: the
    pod's earlier generation, before torchrun restarted its workers in place (an elastic
    membership change). Kept, their `stopped` lines were read as the verdict of this
    generation's workers when these died without a word, and the gang never restarted."""
    oldest = STARTED - GENERATION_GAP_S
    _edit(lambda lines: [v for v in lines if _float(v.get("started")) >= oldest], environ)


def _float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


def _edit(change, environ: dict[str, str] | None) -> None:
    path = (os.environ if environ is None else environ).get(ENV)
    if not path:
        return
    with contextlib.suppress(OSError), open(path, "a+") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        file.seek(0)
        before = _parse_lines(file.read())
        kept = change(before)
        if kept == before:
            return
        file.seek(0)
        file.truncate()
        file.write(_fitted(kept))


def _fitted(lines: list[dict]) -> str:
    """The lines, their messages shortened alike until the whole fits in MAX_BYTES (the
    flags and numbers that decide the failure policy are never cut)."""
    limit = MAX_MESSAGE
    while True:
        text = "".join(
            json.dumps({**v, "message": str(v.get("message") or "")[:limit]}, sort_keys=True) + "\n"
            for v in lines
        )
        if len(text.encode()) <= MAX_BYTES:
            return text
        if limit == 0:
            if len(lines) == 1:
                return text
            # Many ranks in one pod (16 and a long checkpoint URI pass 4096 bytes): the
            # kubelet kept the tail, cutting the telling line. The least telling goes.
            lines = sorted(lines, key=_telling)[:-1]
            continue
        limit = max(0, min(limit - 16, limit * 3 // 4))


def _telling(fields: dict) -> tuple:
    """Sort key of a line: the verdict `read` picks sorts first."""
    code = fields.get("exit_code")
    return (
        _SEVERITY.get(code, 2),  # type: ignore[call-overload]
        not fields.get("completed"),
        not fields.get("stalled"),
    )


def encode(verdict: Verdict) -> str:
    """One line of a termination message."""
    message = scrubbed(verdict.message)[:MAX_MESSAGE]  # the job's status shows it
    fields = {MARK: 1, **asdict(verdict), "message": message}
    return json.dumps(fields, sort_keys=True) + "\n"


def read(message: str) -> Verdict | None:
    """The pod's verdict from its termination message; None when it holds none (a
    process killed before it could write, or log text from FallbackToLogsOnError)."""
    verdicts = []
    for fields in _parse_lines(message):
        try:
            verdicts.append(
                Verdict(
                    exit_code=int(fields["exit_code"]),
                    message=str(fields.get("message") or "")[:MAX_MESSAGE],
                    rank=int(fields.get("rank") or 0),
                    completed=bool(fields.get("completed")),
                    collapsed=bool(fields.get("collapsed")),
                    stopped=bool(fields.get("stopped")),
                    stalled=bool(fields.get("stalled")),
                    step=_int(fields.get("step")),
                    last_checkpoint=_int(fields.get("last_checkpoint")),
                    checkpoint_uri=fields.get("checkpoint_uri") or None,
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    if not verdicts:
        return None
    # Among equally severe lines a stalled rank's is the cause: its peers' errors (a
    # collective broken when it was killed) follow from it.
    return min(verdicts, key=lambda v: _telling(asdict(v)))


def _parse_lines(text: str) -> list[dict]:
    found = []
    for raw in text.splitlines():
        if MARK not in raw:
            continue
        with contextlib.suppress(ValueError):
            fields = json.loads(raw)
            if isinstance(fields, dict) and fields.get(MARK) == 1:
                found.append(fields)
    return found


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
