"""The bearer token of a job's rollout API (POST /generate, POST /weights): its variable,
the header a caller sends, the check an instance makes. Standard library only: the
operator imports it to give the variable to its pods."""

from __future__ import annotations

import hmac
import os

TOKEN_ENV = "RLFT_ROLLOUT_TOKEN"
"""The bearer token of a job's rollout API. The operator draws one per job into the
Secret `<job>-tokens-<uid>` and gives it to the job's trainer and rollout pods;
`rlft train` draws one per run for the servers it starts. Unset, an instance answers
any caller: a server of one's own on loopback."""


def given_token(token: str | None = None) -> str | None:
    """`token`, else $RLFT_ROLLOUT_TOKEN, stripped (a Secret made with `--from-file` ends
    in a newline); None when unset. A token that cannot be sent in a header is refused
    without its value: http.client's own refusal quoted the header, token and all, into
    logs, exceptions and the job's status."""
    value = (token if token is not None else os.environ.get(TOKEN_ENV) or "").strip()
    if not value:
        return None
    if not all(33 <= ord(c) <= 126 for c in value):
        raise ValueError(
            f"{TOKEN_ENV} holds characters a bearer token cannot have (spaces, line breaks, "
            "non-ASCII): set it to the token alone"
        )
    return value


def auth_header(token: str | None) -> dict[str, str]:
    """The header a request to an instance started with `token` carries."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(header: str | None, token: str | None) -> bool:
    """Whether a request's Authorization header opens an instance started with `token`
    (compared in constant time: the time to refuse tells nothing of the token)."""
    if not token:
        return True
    expected = f"Bearer {token}".encode()
    return header is not None and hmac.compare_digest(header.encode(), expected)
