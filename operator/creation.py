"""Children the API server refuses to write: a ResourceQuota exceeded, PodSecurity
admission, an invalid object (422).

Such a refusal is neither the operator's error (retrying it at once only repeats it) nor
the job's failure (raising the quota makes it pass): it becomes the `Created=False`
condition with a reason (QuotaExceeded, Forbidden, Invalid, BadRequest) and the API
server's message, one Warning Event per distinct refusal (the same child refused for the
same reason again is not news), and a wait before any create that doubles with each
refusal in a row. The wait is kept in the status (`createFailure.retryAt`), so a kick
(a pod event, the poll timer) or a new leader waits too. An edit of the spec ends the wait
(the user may have fixed the cause); the first round after the wait in which nothing is
refused clears it (Created=True, a Normal Event).

The API server's message is copied because it is the cause the user must act on
(`pods "x" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=8, …`);
the API server wrote it, not a pod, and it holds no secret. It is capped all the same.

Pure: the handlers make the calls and pass what happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from rlft.operator.status import (
    CreateFailure,
    RLFineTuneStatus,
    parse_time,
    rfc3339,
    set_condition,
)

BACKOFF_SECONDS = 2.0
"""The wait after the first refusal; it doubles with each refusal in a row."""
MAX_BACKOFF_SECONDS = 300.0
"""The longest wait: a quota raised is noticed within five minutes."""
REFUSED_CODES = (400, 403, 422)
"""HTTP statuses that mean "not this object, not now" (others are retried as before)."""
MESSAGE_LIMIT = 512

EventText = tuple[str, str, str]
"""(type, reason, message) of an Event to post on the job."""


@dataclass(frozen=True)
class Refusal:
    """One write the API server refused."""

    verb: str  # create | update
    kind: str
    name: str
    code: int
    message: str


def reason(code: int, message: str) -> str:
    """The condition's reason: what the user has to look at."""
    if code == 403 and "exceeded quota" in message:
        return "QuotaExceeded"
    return {403: "Forbidden", 422: "Invalid", 400: "BadRequest"}.get(code, "Refused")


def backoff_seconds(attempts: int) -> float:
    return min(BACKOFF_SECONDS * 2 ** max(attempts - 1, 0), MAX_BACKOFF_SECONDS)


def hold_seconds(st: RLFineTuneStatus, generation: int | None, now: datetime) -> float | None:
    """Seconds before children may be written again, or None: no refusal is waiting, its
    wait is over, or the spec changed since."""
    record = st.create_failure
    if record is None or record.generation != generation:
        return None
    until = parse_time(record.retry_at)
    if until is None or now >= until:
        return None
    return (until - now).total_seconds()


def after_writes(
    st: RLFineTuneStatus,
    refusal: Refusal | None,
    wrote: bool,
    generation: int | None,
    now: datetime,
) -> tuple[RLFineTuneStatus, EventText | None] | None:
    """The status after a round of writes (`wrote`: some were attempted), and an Event;
    None when nothing changes."""
    previous = st.create_failure
    if refusal is None:
        # A round that wrote nothing clears it too once its wait is over: nothing was
        # refused, and the round whose writes succeeded may not have got its status in
        # (a conflict with another writer), which left Created=False for good.
        held = not wrote and hold_seconds(st, generation, now) is not None
        if previous is None or held:
            return None
        new = st.model_copy(deep=True)
        new.create_failure = None
        message = (
            f"the job's children are created (the API server had refused "
            f"{previous.kind} {previous.name} {previous.attempts} times: {previous.reason})"
        )
        set_condition(new, "Created", "True", "Created", message, now)
        return new, ("Normal", "Created", message)
    why = reason(refusal.code, refusal.message)
    text = refusal.message[:MESSAGE_LIMIT]
    attempts = previous.attempts + 1 if previous is not None else 1
    delay = backoff_seconds(attempts)
    new = st.model_copy(deep=True)
    new.create_failure = CreateFailure(
        kind=refusal.kind,
        name=refusal.name,
        reason=why,
        code=refusal.code,
        message=text,
        attempts=attempts,
        retry_at=rfc3339(now + timedelta(seconds=delay)),
        generation=generation,
    )
    what = f"{refusal.verb} {refusal.kind} {refusal.name}"
    message = f"the API server refused to {what}: {text}; retrying in {delay:g} s"
    set_condition(new, "Created", "False", why, f"{message} (attempt {attempts})", now)
    same = previous is not None and (previous.kind, previous.name, previous.reason) == (
        refusal.kind,
        refusal.name,
        why,
    )
    return new, None if same else ("Warning", why, message)
