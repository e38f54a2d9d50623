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


def test_a_reconcile_in_flight_when_the_replica_pauses_does_not_count_the_job_again(
    monkeypatch,
):
    """kopf stops a job's `_serve` daemon when this replica pauses for another leader;
    a reconcile still writing the status then must not put the job back in
    rlft_operator_jobs, where nothing here would take it out again (summed over the
    replicas, a dashboard would show it twice)."""
    from datetime import UTC, datetime

    from rlft.operator.decision import Decision
    from rlft.operator.status import RLFineTuneStatus

    metrics = OperatorMetrics()
    monkeypatch.setattr(handlers.RUNTIME, "metrics", metrics)
    monkeypatch.setattr(handlers.RUNTIME, "jobs", {})

    class SlowStatusWrites:
        """The API server's part of `_apply`: the status write waits for the test."""

        def __init__(self) -> None:
            self.writing, self.release = asyncio.Event(), asyncio.Event()

        async def patch_job_status(self, *args: object) -> None:
            self.writing.set()
            await self.release.wait()

        async def post_event(self, *args: object) -> None:
            return None

    kube = SlowStatusWrites()
    monkeypatch.setattr(handlers.RUNTIME, "kube", kube)
    key = ("ml", "job")

    async def pause_during_a_reconcile() -> None:
        stopped = asyncio.Event()
        serve = asyncio.create_task(handlers._serve(namespace="ml", name="job", stopped=stopped))
        await asyncio.sleep(0)
        body = {"metadata": {"namespace": "ml", "name": "job", "resourceVersion": "1"}}
        decision = Decision(status=RLFineTuneStatus(phase="Running"))
        now = datetime.now(UTC)
        apply = asyncio.create_task(
            handlers._apply(key, body, RLFineTuneStatus(), decision, now, {})
        )
        await kube.writing.wait()
        stopped.set()  # kopf pauses this replica
        await serve
        kube.release.set()
        await apply

    asyncio.run(pause_during_a_reconcile())
    assert metrics.jobs.labels(phase="Running")._value.get() == 0


def test_a_deleted_jobs_late_pod_events_leave_no_state_or_series_behind(monkeypatch):
    """A deleted job's trainer pods terminate for their grace period after the job's
    DELETED event: each of their events kicked a reconcile that made the job's state
    again ("gone"), kept with its OOM record for the operator's lifetime, and the job's
    restart and rollback series stayed on /metrics."""
    from rlft.operator import failures as P
    from rlft.operator import names as N

    metrics = OperatorMetrics()
    monkeypatch.setattr(handlers.RUNTIME, "metrics", metrics)
    monkeypatch.setattr(handlers.RUNTIME, "jobs", {})

    class NoJob:
        async def get_job(self, namespace: str, name: str) -> None:
            return None  # deleted

    monkeypatch.setattr(handlers.RUNTIME, "kube", NoJob())
    metrics.restarts.labels(rlfinetune="ml/old").inc(2)
    metrics.rollbacks.labels(rlfinetune="ml/old").inc()
    metrics.restarts.labels(rlfinetune="ml/live").inc()
    labels = {N.LABEL_JOB: "old", N.LABEL_ROLE: N.ROLE_TRAINER, N.LABEL_INDEX: "0"}
    pod = {
        "metadata": {"name": "old-trainer-0", "namespace": "ml", "uid": "u1", "labels": labels},
        "status": {"phase": "Failed", "containerStatuses": [{
            "name": "main",
            "state": {"terminated": {"exitCode": 137, "reason": P.OOM}},
        }]},
    }  # fmt: skip
    asyncio.run(handlers._pod_event(namespace="ml", labels=pod["metadata"]["labels"], body=pod))
    assert ("ml", "old") not in handlers.RUNTIME.jobs
    assert metrics.reconciles.labels(result="gone")._value.get() == 1
    exposed = {
        (m.name, s.labels.get("rlfinetune"))
        for m in metrics.registry.collect() for s in m.samples
    }  # fmt: skip
    assert ("rlft_restarts", "ml/live") in exposed
    assert not any(job == "ml/old" for _, job in exposed), exposed
