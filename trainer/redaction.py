"""What a process's own error text loses before it is printed or becomes its verdict (the
termination message the operator copies into the job's status, conditions and Events):
the values of the secrets in its environment, and credentials in URLs. A reward that
calls a judge with its key in the URL, a library error quoting a request: their text
reached the job's status as it was."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

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
    for value in secret_values(environ):
        text = text.replace(value, "***")
    text = _USERINFO.sub(r"\1***@", text)
    return _SECRET_QUERY.sub(r"\1***", text)
