"""The operator reads its memory back from the custom resource's status: a field that
does not parse is dropped alone, never the counted failures with it."""

from __future__ import annotations

from rlft.operator.status import read_status

STORED = {
    "phase": "Failed",
    "message": "too many restarts",
    "restarts": 4,
    "gangAttempt": 4,
    "handledPods": ["uid-a", "uid-b"],
    "restartHistory": ["2026-01-01T00:00:00.000000Z"],
    "conditions": [
        {"type": "Ready", "status": "False", "reason": "TooManyRestarts", "message": ""},
        # a condition type this version does not know (written by a newer operator)
        {"type": "Quarantined", "status": "True", "reason": "X", "message": ""},
    ],
}


def test_a_status_with_a_field_that_does_not_parse_keeps_the_rest():
    status, dropped = read_status(STORED)
    assert dropped == ["conditions[1]"]
    assert status.phase == "Failed" and status.restarts == 4 and status.gang_attempt == 4
    assert status.handled_pods == ["uid-a", "uid-b"]
    assert status.restart_history == ["2026-01-01T00:00:00.000000Z"]
    assert [c.type for c in status.conditions] == ["Ready"]
    broken = {**STORED, "conditions": STORED["conditions"][:1], "restarts": -1}
    status, dropped = read_status(broken)
    assert dropped == ["restarts"] and status.restarts == 0 and status.phase == "Failed"


def test_a_status_that_parses_is_read_whole():
    whole = {**STORED, "conditions": STORED["conditions"][:1]}
    status, dropped = read_status(whole)
    assert dropped == [] and status.handled_pods == ["uid-a", "uid-b"]
    assert read_status(None) == read_status({}) and read_status({})[1] == []
