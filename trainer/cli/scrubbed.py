"""`rlft scrubbed -- COMMAND...`: runs COMMAND with its standard output and error read
through pipes and passed on without the secrets of the environment and of the mounted
Secrets' files (redaction.py). Every container the operator makes runs its command so:
what `rlft`'s own streams scrub misses reaches the file descriptors directly (torchrun's
agent, vLLM's engine process, a reward's subprocess, C libraries' messages, a secret cut
in two by a flush), and the pod's log is read by whoever may `kubectl logs` and kept by
log stores for months.

It stands between the container runtime and COMMAND: the signals a runtime sends (SIGTERM
at a pod's deletion) go on to COMMAND, and it ends with COMMAND's exit code (128 + the
signal's number for a COMMAND killed by one, as a runtime reports that). Only the standard
library, redaction.py and secret_sources.py are imported: it starts in a fraction of a
second."""

from __future__ import annotations

import codecs
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time

from rlft.trainer.redaction import LineScrubber
from rlft.trainer.secret_sources import secret_values

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
"""What goes on to COMMAND (a runtime's stop signal, a shell's, and those a program may
be asked things with). SIGKILL and SIGSTOP cannot be caught: a runtime sends SIGKILL to
every process of the container."""

IDLE_SECONDS = 0.2
"""A partial line (no line end yet) goes on once it has waited this long."""

LONGEST_PARTIAL = 1 << 16
"""A partial line goes on at once when it is longer than this (a line of dots, a long
dump): not kept whole in memory, and looked through in pieces."""

DRAIN_SECONDS = 5.0
"""After COMMAND ends, how long its output is still read: processes it left behind (Ray's
daemons, a daemonised helper) may hold the pipes open for ever."""

USAGE = "usage: rlft scrubbed -- COMMAND [ARGUMENT...]"


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:  # a non-blocking descriptor: wait until it takes more
            select.select([], [fd], [], 1.0)
        except InterruptedError:
            continue
        except OSError:  # the log's reader is gone: nothing left to keep output for
            return


class _Pump(threading.Thread):
    """Copies one pipe to one file descriptor through a LineScrubber. Bytes that are not
    UTF-8 pass unchanged (surrogate escapes both ways)."""

    def __init__(self, source: int, target: int, secrets: list[str]):
        super().__init__(daemon=True, name=f"scrub-fd{target}")
        self._source, self._target = source, target
        self._scrubber = LineScrubber(secrets, words=True, refresh=secret_values)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.command_ended = threading.Event()
        """Set once COMMAND has ended: from then on nothing is held back (no rest of a
        line may come, and what a leftover process keeps open is not waited for)."""

    def _emit(self, text: str) -> None:
        if text:
            _write_all(self._target, text.encode("utf-8", errors="surrogateescape"))

    def run(self) -> None:
        try:
            self._copy()
        except Exception as error:  # not the command's death: its next write would
            # meet a closed pipe (SIGPIPE). Its output is lost instead, never let through.
            self._emit(f"\nrlft scrubbed: output lost from here ({type(error).__name__})\n")
            while os.read(self._source, 1 << 16):
                pass
        finally:
            os.close(self._source)

    def _copy(self) -> None:
        waiting_since = 0.0
        while True:
            ready, _, _ = select.select([self._source], [], [], IDLE_SECONDS)
            if ready:
                chunk = os.read(self._source, 1 << 16)
                if not chunk:
                    break
                self._emit(self._scrubber.lines(self._decoder.decode(chunk)))
            waiting = self._scrubber.waiting
            if not waiting:
                waiting_since = 0.0
                continue
            now = time.monotonic()
            waiting_since = waiting_since or now
            if self.command_ended.is_set() and not ready:
                self._emit(self._scrubber.rest())
            elif not ready or now - waiting_since >= IDLE_SECONDS or waiting > LONGEST_PARTIAL:
                self._emit(self._scrubber.partial())
                waiting_since = now
        self._emit(self._scrubber.lines(self._decoder.decode(b"", final=True)))
        self._emit(self._scrubber.rest())


def _from_the_terminal(signum: int) -> bool:
    """Whether the terminal sent `signum` to the whole foreground process group (Ctrl-C,
    Ctrl-\\), COMMAND included: passed on, it would get it twice (a second Ctrl-C is
    `rlft train`'s "stop now, without a checkpoint")."""
    if signum not in (signal.SIGINT, signal.SIGQUIT):
        return False
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
    return False


def run_scrubbed(command: list[str]) -> int:
    """Runs `command` with its output scrubbed; returns its exit code."""
    secrets = secret_values()
    child: subprocess.Popen | None = None
    early: list[int] = []  # signals that came before the child was there to take them

    def forward(signum: int, _frame) -> None:
        if _from_the_terminal(signum):
            return
        if child is None:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):  # it has just ended
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    pumps = []
    ends = []
    for target in (1, 2):
        read, write = os.pipe()
        pumps.append(_Pump(read, target, secrets))
        ends.append(write)
    try:
        child = subprocess.Popen(command, stdout=ends[0], stderr=ends[1])
    except OSError as error:
        print(f"rlft scrubbed: cannot run {command[0]!r}: {error.strerror}", file=sys.stderr)
        return 127 if isinstance(error, FileNotFoundError) else 126
    finally:
        for end in ends:
            os.close(end)
    for pump in pumps:
        pump.start()
    for signum in early:
        forward(signum, None)
    code = child.wait()
    for pump in pumps:
        pump.command_ended.set()
    drained_by = time.monotonic() + DRAIN_SECONDS
    for pump in pumps:
        pump.join(max(0.0, drained_by - time.monotonic()))
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    """`argv`: what follows `rlft scrubbed` (a leading `--` is dropped)."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__.split(chr(10) + chr(10))[0]}")
        return 0
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print(USAGE, file=sys.stderr)
        return 2
    return run_scrubbed(command)
