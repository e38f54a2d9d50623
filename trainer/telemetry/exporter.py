"""Prometheus collectors built from the metric definitions, fed by per-step records.

The loop calls `exporter.record(step_record)` once per step; the stability guard's
decisions arrive through `exporter.decision(...)`, checkpoints through
`exporter.checkpoint(...)`. Each exporter owns its own `CollectorRegistry` (never the
global one), so several trainers or tests in one process do not collide.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Metric
from prometheus_client.exposition import generate_latest

from rlft.trainer.telemetry import metrics as M


def build_collectors(
    registry: CollectorRegistry, source: str = "trainer"
) -> dict[str, Gauge | Counter | Histogram]:
    """One prometheus_client collector per metric of `source`, registered in `registry`."""
    collectors: dict[str, Gauge | Counter | Histogram] = {}
    for metric in M.METRICS:
        if metric.source != source:
            continue
        if metric.kind == "gauge":
            collectors[metric.name] = Gauge(
                metric.name, metric.help, metric.labels, registry=registry
            )
        elif metric.kind == "counter":
            # prometheus_client appends `_total` itself.
            collectors[metric.name] = Counter(
                metric.name.removesuffix("_total"), metric.help, metric.labels, registry=registry
            )
        else:
            collectors[metric.name] = Histogram(
                metric.name, metric.help, metric.labels, registry=registry, buckets=metric.buckets
            )
    return collectors


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class _SetGauges:
    """The registry's metrics less the unlabelled gauges never set: prometheus_client
    exports those as 0 from the start, so a job that had not evaluated yet (or has no
    reference, critic or experts) showed 0% held-out accuracy, 0 KL, 0 dead experts."""

    def __init__(self, registry: CollectorRegistry, unset: set[str]):
        self._registry = registry
        self.unset = unset

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.name not in self.unset:
                yield family


class MetricsExporter:
    """The trainer's metrics: a registry plus the record → metric mapping."""

    def __init__(self, source: str = "trainer", start_time: float | None = None):
        self.registry = CollectorRegistry()
        self.collectors = build_collectors(self.registry, source)
        self._lock = threading.Lock()
        unset = {m.name for m in M.METRICS if m.source == source and m.kind == "gauge"}
        self._exposed = CollectorRegistry(auto_describe=False)
        self._set_gauges = _SetGauges(self.registry, unset)
        self._exposed.register(self._set_gauges)
        if source == "trainer":
            # Before the first step the run has done 0 steps: RLFTNoProgress needs the
            # series to tell a run stuck before it.
            self._gauge(M.TRAIN_STEP).set(0)
            self._gauge(M.START_TIME).set(start_time if start_time is not None else time.time())
            self._gauge(M.MAIN_PHASE_START).set(0)
            self._gauge(M.HEALTH).set(0)
            for check in M.CHECKS:
                self._gauge(M.CHECK_LEVEL).labels(check=check).set(0)
                for level in ("warning", "critical"):
                    self._counter(M.ALARMS).labels(check=check, level=level)
            self._counter(M.SKIPPED)
            self._counter(M.ROLLBACKS)
            for result in ("ok", "failed"):
                self._counter(M.CHECKPOINTS).labels(result=result)

    def _gauge(self, metric: M.Metric) -> Gauge:
        """The gauge, to be set: exported from now on."""
        self._set_gauges.unset.discard(metric.name)
        return self.collectors[metric.name]  # type: ignore[return-value]

    def _counter(self, metric: M.Metric) -> Counter:
        return self.collectors[metric.name]  # type: ignore[return-value]

    def _export(self, binding: M.Binding, value: float, extra: Mapping[str, str]) -> None:
        collector = self.collectors[binding.metric.name]
        labels = {**binding.labels, **extra}
        child = collector.labels(**labels) if labels else collector
        if binding.metric.kind == "counter":
            if value > 0 and math.isfinite(value):
                child.inc(value)
        else:
            self._set_gauges.unset.discard(binding.metric.name)
            child.set(value)

    def record(self, record: Mapping[str, Any]) -> None:
        """Export one step record (keys as in metrics.jsonl; unknown keys are ignored)."""
        full = {**record, **M.derived(dict(record))}
        with self._lock:
            for key, value in full.items():
                binding = M.BINDINGS.get(key)
                if binding is None:
                    continue
                if binding.dict_label and isinstance(value, Mapping):
                    for name, item in value.items():
                        number = _number(item)
                        if number is not None:
                            self._export(binding, number, {binding.dict_label: str(name)})
                    continue
                number = _number(value)
                if number is not None:
                    self._export(binding, number, {})

    def main_phase_began(self, when: float | None = None) -> None:
        """The algorithm's steps begin in this process: from then on a step counter
        that does not move is a stuck run, even at step 0 (a fresh run's first step)."""
        with self._lock:
            self._gauge(M.MAIN_PHASE_START).set(when if when is not None else time.time())

    def watch_engines(self, count: Callable[[], tuple[int, int]]) -> None:
        """The rollout engine gauges from `count()` (healthy, expected) at each scrape:
        the step records set them only when a step ends, and when every engine dies no
        step ends (the trainer waits for rollouts): RLFTRolloutEnginesDown saw the last
        step's count until the trainer gave up and its series vanished."""
        with self._lock:
            self._gauge(M.ENGINES_HEALTHY).set_function(lambda: count()[0])
            self._gauge(M.ENGINES_EXPECTED).set_function(lambda: count()[1])

    def configure(self, *, staleness_limit: int, checkpoint_interval_s: float) -> None:
        """Export the job's limits that alert rules compare against."""
        with self._lock:
            self._gauge(M.STALENESS_LIMIT).set(staleness_limit)
            self._gauge(M.CHECKPOINT_INTERVAL).set(checkpoint_interval_s)

    def decision(
        self,
        health: str,
        check_levels: Mapping[str, int],
        zscore: float | None,
        action: str,
    ) -> None:
        """Export one guard decision: health, per-check levels, alarms, skips."""
        with self._lock:
            self._gauge(M.HEALTH).set(M.HEALTH_LEVELS[health])
            for check in M.CHECKS:
                level = int(check_levels.get(check, 0))
                self._gauge(M.CHECK_LEVEL).labels(check=check).set(level)
                if level:
                    name = "critical" if level >= 2 else "warning"
                    self._counter(M.ALARMS).labels(check=check, level=name).inc()
            if zscore is not None and math.isfinite(zscore):
                self._gauge(M.GRAD_NORM_ZSCORE).set(zscore)
            if action == "skip":
                self._counter(M.SKIPPED).inc()

    def rolled_back(self) -> None:
        """A rollback made (a checkpoint restored), not only decided."""
        with self._lock:
            self._counter(M.ROLLBACKS).inc()

    def checkpoint(self, step: int, ok: bool, when: float | None = None) -> None:
        """Export one checkpoint attempt."""
        with self._lock:
            self._counter(M.CHECKPOINTS).labels(result="ok" if ok else "failed").inc()
            self._gauge(M.CHECKPOINT_OK).set(1 if ok else 0)
            if ok:
                self._gauge(M.CHECKPOINT_TIME).set(when if when is not None else time.time())
                self._gauge(M.CHECKPOINT_STEP).set(step)

    def restored(self, step: int) -> None:
        """The checkpoint a resume restored is the last one's step (it said 0 until this
        process's first commit). Not its time: the work a crash would lose counts from
        this process's start (RLFTCheckpointTooOld), not from the restored save."""
        with self._lock:
            self._gauge(M.CHECKPOINT_STEP).set(step)

    def checkpoint_retry(self, count: int = 1) -> None:
        """Retried storage operations of a checkpoint upload (any rank's)."""
        with self._lock:
            self._counter(M.CHECKPOINT_RETRIES).inc(count)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self._exposed)
