"""Where a process's secrets are, for `redaction.py` to hide: the variables that hold
secrets by name or because the operator says so, the headers of an OTLP header list,
and the files of the Secrets its pod mounts as volumes. Only the standard library: `rlft
scrubbed` imports this before anything else, in every container."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from collections.abc import Iterable, Mapping
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
"""At most this many files under each mount are read."""

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

NOT_SECRET_ENDINGS = frozenset({"FILE", "PATH", "DIR", "DIRECTORY", "ENV"})
"""Names ending so hold where a secret is (`AWS_WEB_IDENTITY_TOKEN_FILE`, on every IRSA
pod) or which variables hold one (`RLFT_SECRET_ENV`), not a secret: hidden, every error
naming that file or variable lost what it needed to say. The file itself is read (one
named by a `…_FILE` or `…_PATH` variable, see `named_files`)."""

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
"""Where Kubernetes mounts a pod's service account token (`automountServiceAccountToken`):
a bearer token for the API server, read like the Secrets' files."""


def named_as_secret(name: str) -> bool:
    words = name.upper().split("_")
    if words[-1] in NOT_SECRET_ENDINGS or "PUBLIC" in words:
        return False
    return bool(SECRET_WORDS.intersection(words)) or (len(words) > 1 and words[-1] == "KEY")


_SEEN: set[str] = set()
_SEEN_LOCK = threading.Lock()


def _new_lock() -> None:
    """In a forked child: another thread of the parent may have held the lock at the
    fork, and nothing in the child would ever release it."""
    global _SEEN_LOCK
    _SEEN_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock)
_REMEMBERED = [0]
"""How many times `remember` learnt a new value: a scrubber that saw another count asks
again at once, not at its next look."""


def remember(values: Iterable[str | None]) -> None:
    """Credentials this process read from a place no variable or mount names (a local
    run's `spec.checkpoint.credentialsDir`, or one on a volume the operator did not
    mount as a Secret) are its secrets from now on: its verdict and its own output hide
    them, rotated-away ones too."""
    new = {v.strip() for v in values if v and len(v.strip()) >= SHORTEST}
    with _SEEN_LOCK:
        if new - _SEEN:
            _SEEN.update(new)
            _REMEMBERED[0] += 1


def remembered() -> int:
    """The count `remember` keeps (see `_REMEMBERED`)."""
    return _REMEMBERED[0]


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The secrets a process holds: its environment's (by name), the files under its
    Secret mounts (`RLFT_SECRET_PATH`) and those its variables name, longest first.
    Without `environ`, this process's own, every value they held when asked before (a
    rotated credential's old value may still show in an error) and what it `remember`ed."""
    own = environ is None
    environ = os.environ if environ is None else environ
    names = [*SECRET_ENV, *(environ.get(SECRET_NAMES_ENV) or "").split(",")]
    names += [name for name in environ if named_as_secret(name)]
    values = [environ.get(name.strip(), "").strip() for name in names if name.strip()]
    values += [v for name in HEADER_LIST_ENV for v in header_values(environ.get(name) or "")]
    values += secret_file_values(environ.get(SECRET_PATH_ENV) or "")
    values += [v for path in named_files(environ) if (v := read_secret_file(Path(path)))]
    found = {v for v in values if len(v) >= SHORTEST}
    if own:
        with _SEEN_LOCK:
            _SEEN.update(found)
            found = set(_SEEN)
    return sorted(found, key=len, reverse=True)


def named_files(environ: Mapping[str, str]) -> list[str]:
    """The files that variables named for a secret point at, and the service account
    token: `AWS_WEB_IDENTITY_TOKEN_FILE` (IRSA's token), `POSTGRES_PASSWORD_FILE`,
    `HF_TOKEN_PATH`, `GOOGLE_APPLICATION_CREDENTIALS` (a key file's path). Absolute
    paths only: a secret's own value is no file to look for."""
    paths = [SERVICE_ACCOUNT_TOKEN]
    for name, value in environ.items():
        words = name.upper().split("_")
        stem = "_".join(words[:-1]) if words[-1] in ("FILE", "PATH") else name
        if value.startswith("/") and stem and named_as_secret(stem):
            paths.append(value)
    return paths


def read_secret_file(path: Path) -> str | None:
    """A regular file's text, stripped (None for anything else, over LARGEST_SECRET_FILE
    or unreadable): a FIFO or a device would block the read, or never end."""
    with contextlib.suppress(OSError, ValueError):  # ValueError: a NUL in the path
        info = path.stat()
        if stat.S_ISREG(info.st_mode) and info.st_size <= LARGEST_SECRET_FILE:
            return path.read_bytes().decode("utf-8", "surrogateescape").strip()
    return None


def looked_for(secrets: Iterable[str]) -> list[str]:
    """What text is searched for, longest first (a secret containing another goes
    whole): each secret; each string in one that is JSON (a service account's key file,
    whose `private_key` a program prints decoded); and each line of those of several
    lines (a PEM key reaches a stream cut at its line ends). Parts under SHORTEST
    characters are not looked for."""
    found = set(secrets)
    parts: list[str] = []
    for secret in found:
        for piece in (secret, *_json_strings(secret)):
            parts += [piece, *piece.splitlines()]
    found.update(part for part in parts if len(part.strip()) >= SHORTEST)
    return sorted(found, key=len, reverse=True)


def _json_strings(text: str) -> list[str]:
    """The strings inside `text` when it is a JSON object or array (at most 10,000)."""
    if text.lstrip()[:1] not in ("{", "["):
        return []
    try:
        stack = [json.loads(text)]
    except Exception:  # not JSON, or nested past the parser's depth: nothing inside
        return []
    strings: list[str] = []
    while stack and len(strings) < 10_000:
        item = stack.pop()
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, dict):
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return strings


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
    except Exception:  # not JSON, or nested past the parser's depth
        return []
    if not isinstance(roots, list):
        return []
    values: list[str] = []
    for root in roots:
        if not isinstance(root, str):
            continue
        values += [v for path in files_under(root) if (v := read_secret_file(path)) is not None]
    return values


def files_under(root: str) -> list[Path]:
    """The files of a Secret's mount (itself, for a subPath mount of one key), at most
    MOST_SECRET_FILES, each once: links are followed (the keys are links into `..data`,
    a key `a/b` a linked folder), a folder reached twice is not read again, and names
    starting with `..` are the kubelet's own."""
    found: list[Path] = []
    with contextlib.suppress(OSError, ValueError):  # a path with a NUL in it
        if os.path.isfile(root):
            return [Path(root)]
        seen: set[tuple[int, int]] = set()
        for folder, subfolders, files in os.walk(root, followlinks=True):
            info = os.stat(folder)
            if (info.st_dev, info.st_ino) in seen:  # a loop of links
                subfolders[:] = []
                continue
            seen.add((info.st_dev, info.st_ino))
            subfolders[:] = sorted(d for d in subfolders if not d.startswith(".."))
            found += [Path(folder, f) for f in sorted(files) if not f.startswith("..")]
            if len(found) >= MOST_SECRET_FILES:
                break
    return found[:MOST_SECRET_FILES]
