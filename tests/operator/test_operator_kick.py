"""A reconcile that raises something other than an API error (a bug in the operator)
is counted as `result="error"` and logged with its traceback, and the job's next kick
reconciles it again; one job's failure is not another's."""

from __future__ import annotations

import asyncio
import logging

from rlft.operator import handlers
from rlft.operator.metrics import OperatorMetrics


def test_an_unexpected_error_in_a_reconcile_is_counted_logged_and_not_sticky(monkeypatch, caplog):
    metrics = OperatorMetrics()
    monkeypatch.setattr(handlers.RUNTIME, "metrics", metrics)
    monkeypatch.setattr(handlers.RUNTIME, "jobs", {})
    calls: list[tuple[str, str]] = []

    async def reconcile_once(key, state) -> str:
        calls.append(key)
        if key == ("ml", "broken") and calls.count(key) == 1:
            raise ValueError("a bug in pod rendering")
        return "ok"

    monkeypatch.setattr(handlers, "_reconcile_once", reconcile_once)

    async def kicks() -> None:
        await handlers.kick(("ml", "broken"))  # raised inside: must not escape
        await handlers.kick(("ml", "other"))
        await handlers.kick(("ml", "broken"))  # the next kick (the job's timer) retries

    with caplog.at_level(logging.ERROR):
        asyncio.run(kicks())
    assert calls == [("ml", "broken"), ("ml", "other"), ("ml", "broken")]
    counted = metrics.reconciles.labels(result="error")._value.get()
    assert counted == 1 and metrics.reconciles.labels(result="ok")._value.get() == 2
    assert "ml/broken: reconcile failed" in caplog.text and "a bug in pod rendering" in caplog.text
    assert not handlers.RUNTIME.jobs[("ml", "broken")].lock.locked()
