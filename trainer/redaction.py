"""What a process's own text loses before it is printed or becomes its verdict (the
termination message the operator copies into the job's status, conditions and Events):
the values of the secrets in its environment, and credentials in URLs. A reward that
calls a judge with its key in the URL, a library error quoting a request: their text
reached the job's status as it was.

`scrub_output` puts every line the `rlft` process prints through the same filter (its
own log lines, a reward's prints, libraries' logging and warnings): the pod's log is read
by whoever may `kubectl logs`, and collected into log stores that keep it for months."""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterable, Mapping

SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "RLFT_ROLLOUT_TOKEN",
    "RAY_AUTH_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
)
"""Variables that hold secrets wherever they are set."""
SECRET_NAMES_ENV = "RLFT_SECRET_ENV"
"""Set by the operator: the names (comma-separated) of the job's own variables it fills
from Secrets (`valueFrom.secretKeyRef` in spec.trainer.env / spec.rollout.env)."""

SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS"}
)
"""A variable whose name has one of these words (split at `_`), or ends in `_KEY`, is
taken for a secret whoever set it: values from `envFrom` Secrets reach the environment
under their keys' names, which neither the operator (it never reads Secrets) nor the
trainer can list. `TOKENIZERS_PARALLELISM` is no secret: whole words only."""

SHORTEST = 8
"""Values shorter than this are not hidden: a variable set to `main` or `true` would
blank that word out of every message."""

_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")
# A query parameter whose name is, or ends in, one of these words (`api_key`,
# `X-Amz-Signature`), not one that merely contains it (`author`, `design`).
_SECRET_QUERY = re.compile(
    r"([?&](?:[^=&\s]*[_.-])?(?:api[_-]?key|key|token|secret|signature|sig|password|passwd|"
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
    environ = os.environ if environ is None else environ
    names = [*SECRET_ENV, *(environ.get(SECRET_NAMES_ENV) or "").split(",")]
    names += [name for name in environ if named_as_secret(name)]
    values = (environ.get(name.strip(), "").strip() for name in names if name.strip())
    return sorted({v for v in values if len(v) >= SHORTEST}, key=len, reverse=True)


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


class ScrubbedStream:
    """A text stream that passes on what is written to it `scrubbed`, a line at a time: a
    secret printed in pieces (`print("key", key)` writes each argument on its own) is
    whole when it is looked for. A partial line goes on at `flush` (a prompt, a progress
    bar's `\r` update); a secret cut by a flush in its middle is the one case it misses.
    Everything else (fileno, isatty, encoding, buffer) is the wrapped stream's."""

    def __init__(self, stream, secrets: list[str]):
        self._stream = stream
        # A secret of several lines (a PEM key, a service account's JSON) reaches `write`
        # cut at its line ends: each of its lines is looked for as well.
        lines = {line for value in secrets for line in value.splitlines()}
        extra = [line for line in lines if len(line.strip()) >= SHORTEST]
        self._secrets = sorted(set(secrets) | set(extra), key=len, reverse=True)
        self._pending: list[str] = []
        # Reentrant: a signal handler that prints runs on the main thread, maybe inside
        # a write of its own (a plain lock would deadlock there).
        self._lock = threading.RLock()

    def _locked(self) -> bool:
        """Take the lock; at interpreter shutdown give up after a second (a daemon thread
        frozen while holding it would hang the exit's flush), as CPython's streams do."""
        return self._lock.acquire(timeout=1 if sys.is_finalizing() else -1)

    def write(self, text: str) -> int:
        if not self._locked():
            return 0
        try:
            cut = max(text.rfind("\n"), text.rfind("\r")) + 1
            if not cut:
                self._pending.append(text)  # joined once its line ends: not quadratic
            else:
                lines = "".join(self._pending) + text[:cut]
                self._pending = [text[cut:]] if cut < len(text) else []
                self._stream.write(_without(lines, self._secrets))
        finally:
            self._lock.release()
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._locked():
            return
        try:
            if self._pending:
                pending, self._pending = "".join(self._pending), []
                self._stream.write(_without(pending, self._secrets))
            self._stream.flush()
        finally:
            self._lock.release()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def scrub_output(environ: Mapping[str, str] | None = None) -> None:
    """From now on this process's `sys.stdout` and `sys.stderr` are `ScrubbedStream`s of
    the secrets its environment holds now. Output written to the file descriptors
    directly (C libraries, child processes that are not `rlft`) does not pass here."""
    secrets = secret_values(environ)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ScrubbedStream):
            setattr(sys, name, ScrubbedStream(stream, secrets))
