"""What a process's own text loses before it is printed or becomes its verdict (the
termination message the operator copies into the job's status, conditions and Events):
the values of the secrets in its environment, and credentials in URLs. A reward that
calls a judge with its key in the URL, a library error quoting a request: their text
reached the job's status as it was.

`scrub_output` puts every line the `rlft` process prints through the same filter (its
own log lines, a reward's prints, libraries' logging and warnings): the pod's log is read
by whoever may `kubectl logs`, and collected into log stores that keep it for months."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from urllib.parse import unquote

SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "RLFT_ROLLOUT_TOKEN",
    "RAY_AUTH_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    # Where OpenTelemetry exporters take a collector's auth header (`Authorization=…`).
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
    "OTEL_EXPORTER_OTLP_LOGS_HEADERS",
)
"""Variables that hold secrets wherever they are set."""
HEADER_LIST_ENV = tuple(name for name in SECRET_ENV if name.endswith("_HEADERS"))
"""Of those, the ones holding OTLP's header list (`k=v,k2=v2`, values URL-encoded): an
exporter's error or debug log shows one header, decoded (`'Authorization': 'Bearer …'`)."""
SECRET_NAMES_ENV = "RLFT_SECRET_ENV"
"""Set by the operator: the names (comma-separated) of the job's own variables it fills
from Secrets (`valueFrom.secretKeyRef` in spec.trainer.env / spec.rollout.env)."""

SECRET_PATH_ENV = "RLFT_SECRET_PATH"
"""Set by the operator: where the container's Secret volumes are mounted, as a JSON list
of absolute paths (a mount path may hold any character but `/`). Each file there, in
subfolders too, holds a secret: a judge's key read from a mounted Secret (how Kubernetes
advises handing over keys) is as secret as one in a variable."""

LARGEST_SECRET_FILE = 1 << 20
"""Bigger files under a Secret's mount are not read: a Secret holds at most 1 MiB."""

MOST_SECRET_FILES = 256
"""At most this many files under all the mounts together are read."""

REFRESH_SECONDS = 10.0
"""How often a long-lived scrubber (a pod's `rlft scrubbed`, a process's streams) looks
at the environment and the Secret files again: the kubelet rewrites a mounted Secret
when it changes (credentials rotated under `spec.checkpoint.credentialsDir`), and the new
value is as secret as the old one, which stays hidden too."""

SECRET_WORDS = frozenset(
    {
        "TOKEN",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWD",
        "PASSPHRASE",
        "APIKEY",
        "CREDENTIAL",
        "CREDENTIALS",
        "PAT",
        "DSN",
        "WEBHOOK",
        "COOKIE",
    }
)
"""A variable whose name has one of these words (split at `_`), or ends in `_KEY`, is
taken for a secret whoever set it: values from `envFrom` Secrets reach the environment
under their keys' names, which neither the operator (it never reads Secrets) nor the
trainer can list. `TOKENIZERS_PARALLELISM` is no secret, nor is `LD_LIBRARY_PATH`: whole
words only. A personal access token (`GITHUB_PAT`), a Sentry DSN and a chat webhook's URL
carry their key in the value."""

SHORTEST = 8
"""Values shorter than this are not hidden: a variable set to `main` or `true` would
blank that word out of every message."""

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


NOT_SECRET_ENDINGS = frozenset({"FILE", "PATH", "DIR", "DIRECTORY", "ENV"})
"""Names ending so hold where a secret is (`AWS_WEB_IDENTITY_TOKEN_FILE`, on every IRSA
pod) or which variables hold one (`RLFT_SECRET_ENV`), not a secret: hidden, every error
naming that file or variable lost what it needed to say."""


def named_as_secret(name: str) -> bool:
    words = name.upper().split("_")
    if words[-1] in NOT_SECRET_ENDINGS or "PUBLIC" in words:
        return False
    return bool(SECRET_WORDS.intersection(words)) or (len(words) > 1 and words[-1] == "KEY")


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The secrets a process holds: its environment's (by name) and the files under its
    Secret mounts (`RLFT_SECRET_PATH`), longest first."""
    environ = os.environ if environ is None else environ
    names = [*SECRET_ENV, *(environ.get(SECRET_NAMES_ENV) or "").split(",")]
    names += [name for name in environ if named_as_secret(name)]
    values = [environ.get(name.strip(), "").strip() for name in names if name.strip()]
    values += [v for name in HEADER_LIST_ENV for v in header_values(environ.get(name) or "")]
    values += secret_file_values(environ.get(SECRET_PATH_ENV) or "")
    return sorted({v for v in values if len(v) >= SHORTEST}, key=len, reverse=True)


def header_values(headers: str) -> list[str]:
    """Each value of a `k=v,k2=v2` header list, as written and URL-decoded, and the
    credentials after an auth scheme's name (`Bearer x` → `x`)."""
    values: list[str] = []
    for pair in headers.split(","):
        _, equals, written = pair.partition("=")
        if not equals:
            continue
        for value in {written.strip(), unquote(written).strip()}:
            values.append(value)
            _, space, credentials = value.partition(" ")
            if space:
                values.append(credentials.strip())
    return values


def secret_file_values(mounts: str) -> list[str]:
    """The contents of the files under `mounts` (`RLFT_SECRET_PATH`'s JSON list), each
    stripped. A kubelet writes a Secret's keys into a hidden folder (`..2026_12_07_…`)
    that `..data` points at, with a link per key beside it: names starting with `..` are
    its bookkeeping, not keys (a key may start with one `.`). What cannot be read, or is
    not a JSON list of paths, is passed over: scrubbing never stops a process."""
    try:
        roots = json.loads(mounts) if mounts.strip() else []
    except ValueError:
        return []
    if not isinstance(roots, list):
        return []
    values: list[str] = []
    for path in _files_under([r for r in roots if isinstance(r, str)]):
        with contextlib.suppress(OSError):
            if path.stat().st_size <= LARGEST_SECRET_FILE:
                values.append(path.read_bytes().decode("utf-8", "surrogateescape").strip())
    return values


def _files_under(roots: list[str]) -> list[Path]:
    found: list[Path] = []
    for root in roots:
        if os.path.isfile(root):
            found.append(Path(root))
            continue
        # Following links: the keys are links (into `..data`), a key `a/b` a linked folder.
        for folder, subfolders, files in os.walk(root, followlinks=True):
            subfolders[:] = sorted(d for d in subfolders if not d.startswith(".."))
            found += [Path(folder, f) for f in sorted(files) if not f.startswith("..")]
            if len(found) >= MOST_SECRET_FILES:
                return found[:MOST_SECRET_FILES]
    return found[:MOST_SECRET_FILES]


def scrubbed(text: str, environ: Mapping[str, str] | None = None) -> str:
    """`text` without the environment's secret values, URL user-info parts (`user:pw@`,
    `token@`) and the values of URL query parameters named as a key, token, secret or
    signature."""
    return _without(text, secret_values(environ))


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


def _unsafe_tail(text: str, secrets: Iterable[str], words: bool) -> int:
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
    for secret in secrets:
        window = text[-(len(secret) - 1) :] if len(secret) > 1 else ""
        start = window.find(secret[0]) if window else -1
        while start != -1:  # from the left: the first match is the longest
            if secret.startswith(window[start:]):
                held = max(held, len(window) - start)
                break
            start = window.find(secret[0], start + 1)
    return held


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
        self._learn(secrets)
        self._refresh = refresh
        """Where the secrets come from (`secret_values`), asked again every
        REFRESH_SECONDS: what it adds is hidden from then on, and nothing is forgotten."""
        self._refreshed = time.monotonic()
        self._pending: list[str] = []

    def _learn(self, secrets: Iterable[str]) -> None:
        new = set(secrets) - self._known
        if not new:
            return
        self._known |= new
        # A secret of several lines (a PEM key, a service account's JSON) arrives cut at
        # its line ends: each of its lines is looked for as well.
        lines = {line for value in new for line in value.splitlines()}
        extra = {line for line in lines if len(line.strip()) >= SHORTEST}
        self._secrets = sorted({*self._secrets, *new, *extra}, key=len, reverse=True)

    def _look_again(self) -> None:
        if self._refresh is None or time.monotonic() - self._refreshed < REFRESH_SECONDS:
            return
        self._refreshed = time.monotonic()
        self._learn(self._refresh())

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
        held = _unsafe_tail(pending, self._secrets, self._words)
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
        parent passes it on; the child printed it again inside its own output)."""
        self._lock = threading.RLock()
        self._scrubber.forget()

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
    secrets = secret_values(environ)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ScrubbedStream):
            refresh = functools.partial(secret_values, environ)
            setattr(sys, name, ScrubbedStream(stream, secrets, refresh=refresh))
