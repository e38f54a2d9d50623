"""What a process's own text loses before it is printed or becomes its verdict (the
termination message the operator copies into the job's status, conditions and Events):
the values of its secrets (those of its environment and of its mounted Secrets' files:
`secret_sources.py`), and credentials in URLs. A reward that calls a judge with its key
in the URL, a library error quoting a request: their text reached the job's status as
it was.

`scrub_output` puts every line the `rlft` process prints through the same filter (its
own log lines, a reward's prints, libraries' logging and warnings): the pod's log is read
by whoever may `kubectl logs`, and collected into log stores that keep it for months."""

from __future__ import annotations

import atexit
import bisect
import contextlib
import functools
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from rlft.trainer.secret_sources import looked_for, remembered, secret_values

REFRESH_SECONDS = 10.0
"""How often a long-lived scrubber (a pod's `rlft scrubbed`, a process's streams) looks
at the environment and the Secret files again: the kubelet rewrites a mounted Secret
when it changes (credentials rotated under `spec.checkpoint.credentialsDir`), and the new
value is as secret as the old one, which stays hidden too. A process's own streams also
look at once after it `remember`ed credentials it read itself."""

# A scheme starts where a run of scheme characters does (not at each `\b` inside one:
# a long run such as `a-a-a-…` made the search quadratic).
_SCHEME = r"(?<![a-zA-Z0-9+.-])[a-zA-Z][a-zA-Z0-9+.-]*"
_USERINFO = re.compile(rf"({_SCHEME}://)[^/\s@]+@")
# A query parameter whose name is, or ends in, one of these words (`api_key`,
# `X-Amz-Signature`), not one that merely contains it (`author`, `design`). A name
# stops at the next `?` too: a run of `?` made every one of them rescan the rest.
_SECRET_QUERY = re.compile(
    r"([?&](?:[^=&?\s]*[_.-])?(?:api[_-]?key|key|token|secret|signature|sig|password|passwd|"
    r"credentials?|auth)=)[^&\s#'\"]+",
    re.IGNORECASE,
)


def scrubbed(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` without the secrets of the environment and the mounted Secrets (this
    process's own, past values included, without `environ`), URL user-info parts
    (`user:pw@`, `token@`) and the values of URL query parameters named as a key, token,
    secret or signature."""
    return _without(text, looked_for(secret_values(environ)))


def _without(text: str, values: Iterable[str]) -> str:
    for value in values:  # longest first: a secret containing another goes whole
        text = text.replace(value, "***")
    text = _USERINFO.sub(r"\1***@", text)
    return _SECRET_QUERY.sub(r"\1***", text)


LONGEST_HELD_WORD = 4096
"""A partial line's last word waits for more text up to this length: a URL's credentials
are looked for within one word (no pattern spans whitespace), and a word cut in two by a
flush (`https` | `://me:pw@host`) would hide them from both halves."""
# From a word's start only: `\S+$` ran from each character of a long word that a space
# ended, on every flush.
_LAST_WORD = re.compile(r"(?<!\S)\S+$")
_URL_MARKS = frozenset(":?&")
_SCHEME_SO_FAR = re.compile(_SCHEME + "$")


class Beginnings:
    """The secrets indexed for one question: how long is the longest end of a text that
    begins one of them (and is shorter than it)? Asked of every partial line, against
    every value looked for: a Secret holding a certificate bundle makes each of its
    thousands of lines one, and a loop over them cost a millisecond per flush."""

    HEAD = 8
    """Beginnings of up to this many characters are kept in a set: an end whose first
    HEAD characters begin no secret is passed over without a search."""

    def __init__(self, secrets: Iterable[str] = ()):
        self._ordered = sorted(set(secrets))
        self._heads = {
            s[:k] for s in self._ordered for k in range(1, min(self.HEAD, len(s) - 1) + 1)
        }
        self._longest = max(map(len, self._ordered), default=0)

    def longest_end(self, text: str) -> int:
        """The length of the longest end of `text` that is the beginning of a secret
        longer than it (0 for none)."""
        size = len(text)
        for length in range(min(size, self._longest - 1), 0, -1):
            start = size - length
            if text[start : start + self.HEAD] not in self._heads:
                continue
            end = text[start:]
            # The first secret after `end` in order begins with it if any secret does.
            at = bisect.bisect_right(self._ordered, end)
            if at < len(self._ordered) and self._ordered[at].startswith(end):
                return length
        return 0


def _unsafe_tail(text: str, beginnings: Beginnings, words: bool) -> int:
    """How many characters at the end of a partial line (its whole secrets already
    hidden) wait for the rest of it: any end that begins a secret and, with `words`, the
    end of its last word that may still become a URL's credentials or a secret query
    parameter: all of a word with a `:`, `?` or `&`, or what may be a scheme so far (a
    line of dots goes on)."""
    held = 0
    word = _LAST_WORD.search(text[-(LONGEST_HELD_WORD + 1) :]) if words else None
    if word and len(word.group()) <= LONGEST_HELD_WORD:
        if _URL_MARKS.intersection(word.group()):
            held = len(word.group())
        elif scheme := _SCHEME_SO_FAR.search(word.group()):
            held = len(scheme.group())
    return max(held, beginnings.longest_end(text))


class LineScrubber:
    """Text in, `scrubbed` text out, a line at a time: a secret printed in pieces
    (`print("key", key)` writes each argument on its own) is whole when it is looked for.
    A partial line can go on before its end (`partial`: a prompt, a progress bar), less
    any end of it that may be the start of a secret, which waits for the next text; with
    `words`, so does its last word, where a URL's credentials may be cut (a terminal's
    progress bar would lose its last column: only for output nobody watches live)."""

    def __init__(
        self,
        secrets: Iterable[str],
        words: bool = False,
        refresh: Callable[[], Iterable[str]] | None = None,
    ):
        self._words = words
        self._known: set[str] = set()
        self._secrets: list[str] = []
        self._beginnings = Beginnings()
        self._learn(secrets)
        self._refresh = refresh
        """Where the secrets come from (`secret_values`), asked again every
        REFRESH_SECONDS and at once after a `remember`: what it adds is hidden from then
        on, and nothing is forgotten."""
        self._refreshed = time.monotonic()
        self._remembered = remembered()
        self._pending: list[str] = []

    def _learn(self, secrets: Iterable[str]) -> None:
        new = set(secrets) - self._known
        if not new:
            return
        self._known |= new
        self._secrets = sorted({*self._secrets, *looked_for(new)}, key=len, reverse=True)
        self._beginnings = Beginnings(self._secrets)

    def _look_again(self) -> None:
        # Credentials this process read itself (`secret_sources.remember`) are asked for
        # at once: the next line may be the error that quotes them.
        count = remembered()
        if self._refresh is None or (
            count == self._remembered and time.monotonic() - self._refreshed < REFRESH_SECONDS
        ):
            return
        self._refreshed, self._remembered = time.monotonic(), count
        try:
            fresh = list(self._refresh())
        except Exception:  # what is known stays hidden: scrubbing never stops output
            return
        self._learn(fresh)

    def lines(self, text: str) -> str:
        """Takes `text`; returns the lines it ended, scrubbed ("" when it ended none)."""
        self._look_again()
        cut = max(text.rfind("\n"), text.rfind("\r")) + 1
        if not cut:
            self._pending.append(text)  # joined once its line ends: not quadratic
            return ""
        lines = "".join(self._pending) + text[:cut]
        self._pending = [text[cut:]] if cut < len(text) else []
        return _without(lines, self._secrets)

    @property
    def waiting(self) -> int:
        """How many characters of a partial line wait for its end."""
        return sum(map(len, self._pending))

    def partial(self) -> str:
        """The partial line so far, scrubbed, less an end that may begin a secret (or,
        with `words`, its last word), which stays for the text to come."""
        if not self._pending:  # the usual flush, after a whole line (logging's, each record)
            return ""
        self._look_again()
        # Whole secrets first: a cut inside one (a secret ending as it begins) would
        # hide it from both halves. Hidden again with what follows, `***` stays.
        pending = _without("".join(self._pending), self._secrets)
        held = _unsafe_tail(pending, self._beginnings, self._words)
        self._pending = [pending[len(pending) - held :]] if held else []
        return pending[: len(pending) - held]

    def forget(self) -> None:
        """Drops what waits: in a forked child, it is the parent's to pass on."""
        self._pending = []

    def rest(self) -> str:
        """All that is left, scrubbed: the text has ended."""
        self._look_again()
        pending, self._pending = "".join(self._pending), []
        return _without(pending, self._secrets)


class ScrubbedStream:
    """A text stream that passes on what is written to it through a `LineScrubber`. A
    partial line goes on at `flush`, less an end that may begin a secret, which goes with
    the next line end, flush or `finish` (at exit). Unless the stream is a terminal, so
    does a last word that may still become a URL's credentials (`words`: a file or a
    pipe is read later, a terminal's prompt now). Everything else (fileno, isatty,
    encoding, buffer) is the wrapped stream's."""

    def __init__(
        self,
        stream,
        secrets: list[str],
        words: bool | None = None,
        refresh: Callable[[], Iterable[str]] | None = None,
    ):
        self._stream = stream
        if words is None:
            words = not _is_terminal(stream)
        self._scrubber = LineScrubber(secrets, words=words, refresh=refresh)
        # Reentrant: a signal handler that prints runs on the main thread, maybe inside
        # a write of its own (a plain lock would deadlock there).
        self._lock = threading.RLock()
        atexit.register(self.finish)  # before Python's last flush of the std streams
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        """In a forked child (a reward's multiprocessing pool): a new lock, as another
        thread may have held the parent's at the fork, and none of the parent's text (the
        parent passes it on; the child printed it again inside its own output). A
        multiprocessing child ends by `os._exit`, which runs no atexit: what it holds of
        its last line is passed on by its exit's finalizers instead."""
        self._lock = threading.RLock()
        self._scrubber.forget()
        if (util := sys.modules.get("multiprocessing.util")) is not None:
            # Its bootstrap clears the finalizers the fork copied, then runs these.
            util.register_after_fork(self, _finish_at_exit)

    def _locked(self, ending: bool = False) -> bool:
        """Take the lock; while the process ends give up after a second (a daemon thread
        frozen while holding it would hang the exit's flush), as CPython's streams do."""
        return self._lock.acquire(timeout=1 if ending or sys.is_finalizing() else -1)

    def write(self, text: str) -> int:
        if not self._locked():
            return 0
        try:
            lines = self._scrubber.lines(text)
            if lines:
                self._stream.write(lines)
        finally:
            self._lock.release()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._pass_on(self._scrubber.partial)

    def finish(self) -> None:
        """Passes on all that is left (at exit; not to a stream closed by then)."""
        with contextlib.suppress(ValueError, OSError):
            self._pass_on(self._scrubber.rest, ending=True)

    def _pass_on(self, take, ending: bool = False) -> None:
        if not self._locked(ending):
            return
        try:
            text = take()
            if text:
                self._stream.write(text)
            self._stream.flush()
        finally:
            self._lock.release()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _finish_at_exit(stream: ScrubbedStream) -> None:
    """In a multiprocessing child: `stream.finish` among the last of its exit's
    finalizers (`multiprocessing.util._exit_function`, before its `os._exit`)."""
    from multiprocessing import util

    def finish() -> None:
        # The child's threads are joined only after its finalizers: one still writing
        # could complete a secret whose first part had gone on.
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        stream.finish()

    util.Finalize(None, finish, exitpriority=-100)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no such method, or closed
        return False


def finish_output() -> None:
    """Passes on what `ScrubbedStream`s of stdout and stderr hold back: before `os._exit`,
    which runs no atexit."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, ScrubbedStream):
            stream.finish()


def scrub_output(environ: Mapping[str, str] | None = None) -> None:
    """From now on this process's `sys.stdout` and `sys.stderr` are `ScrubbedStream`s of
    the secrets its environment and Secret mounts hold (looked at again every
    REFRESH_SECONDS). Output written to the file descriptors directly (C libraries,
    child processes that are not `rlft`) does not pass here."""
    refresh = functools.partial(secret_values, environ)
    secrets = refresh()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ScrubbedStream):
            setattr(sys, name, ScrubbedStream(stream, secrets, refresh=refresh))
