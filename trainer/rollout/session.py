"""What trainer rank 0 needs to get rollouts for the loop: the engine(s), the pipeline,
the weight publisher, and the local rollout servers it started (stopped by `close`).

`spec.rollout.local` decides (auto: in-process for one transformers instance with
maxStaleness 0, as the synchronous loop always did; servers otherwise).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlft.trainer.config.model import vllm_cpu_head_problem
from rlft.trainer.learner.faults import operator_gang_attempt
from rlft.trainer.rollout.pipeline import Produce, RolloutPipeline, never

if TYPE_CHECKING:
    from rlft.trainer.config import RLFineTune
    from rlft.trainer.rollout.transformers_engine import TransformersEngine


class Cursor(Protocol):
    """The run's cursor (`rlft.trainer.run.state.Cursor`): its version and streams."""

    policy_version: int
    rng: random.Random
    generator: torch.Generator

    def set_streams(self, streams: dict[str, Any]) -> None: ...


URLS_ENV = "RLFT_ROLLOUT_URLS"
"""On Kubernetes: the rollout instances the operator created (comma-separated URLs)."""
CPUS_ENV = "RLFT_ROLLOUT_CPUS"
"""Local runs: pin rollout servers to CPUs, e.g. `1` or `1;2` (one set per instance)."""


@dataclass(frozen=True)
class EngineChoice:
    engine: str
    reason: str
    """Why, for the run's first lines."""


def choose_engine(rollout, gpu: bool | None = None) -> EngineChoice:
    """The engine a local run uses. `auto` is vLLM only where it is faster: installed and
    with a GPU to generate on. On the CPU the trainer's own model in process is faster:
    measured on the example job, vLLM's CPU server took 0.346 s of a 0.645 s step waiting
    for generation, in process 0.144 s of 0.467 s (and servers cost a weight copy per
    step)."""
    if rollout.engine != "auto":
        return EngineChoice(rollout.engine, "spec.rollout.engine")
    if rollout.local == "in-process":
        return EngineChoice("transformers", "auto, spec.rollout.local: in-process")
    from rlft.trainer.rollout.local import vllm_python

    if vllm_python() is None:
        return EngineChoice("transformers", "auto: no vLLM here (`make vllm` builds one)")
    if gpu is None:
        gpu = torch.cuda.is_available()
    if not gpu:
        why = "auto: vLLM is installed, but on the CPU generating in process is faster"
        return EngineChoice("transformers", why)
    return EngineChoice("vllm", "auto: vLLM is installed and a GPU is visible")


def local_engine(rollout) -> str:
    return choose_engine(rollout).engine


def local_engine_problem(rollout, model_config: dict) -> str | None:
    """Why this run's own rollout servers could not serve the model, found before the
    warm start spends its time (vLLM on the CPU refuses small heads only once it loads
    the warm-started weights); None when they can or the operator runs them."""
    if operator_instances() or not uses_servers(rollout) or local_engine(rollout) != "vllm":
        return None
    problem = None if torch.cuda.is_available() else vllm_cpu_head_problem(model_config)
    return None if problem is None else f"spec.rollout.engine: {problem}"


def pods_start_within(job: RLFineTune) -> float:
    """How long the operator's rollout pods may take to answer at all: placed within the
    scheduling timeout, serving within their startup probe's (a large model's vLLM loads
    for many minutes; the trainer gave up after requestTimeoutSeconds, each attempt a
    counted restart that loaded the model again)."""
    rollout, scheduling = job.spec.rollout, job.spec.scheduling
    placed_and_started = scheduling.scheduling_timeout_seconds + rollout.startup_timeout_seconds
    return float(max(rollout.request_timeout_seconds, placed_and_started))


def request_deadline(job: RLFineTune) -> float:
    """How long a generate request's attempts may take together: twice
    requestTimeoutSeconds (one re-issue after a time-out), but within the trainer's stall
    timeout, where there is one: rank 0 waiting on a request that hangs shows no progress,
    and a longer deadline was judged a stall before it could name the instances."""
    timeout = job.spec.rollout.request_timeout_seconds
    stall = job.spec.trainer.stall_timeout_seconds
    deadline = 2 * timeout
    return min(deadline, max(timeout, 0.9 * stall)) if stall else deadline


def operator_instances() -> list[str]:
    """The rollout instances the operator created for this job (none when run locally)."""
    return [u.strip() for u in os.environ.get(URLS_ENV, "").split(",") if u.strip()]


def uses_servers(rollout) -> bool:
    if operator_instances():
        return True
    if rollout.local != "auto":
        return rollout.local == "servers"
    engine = local_engine(rollout)
    return rollout.instances > 1 or rollout.max_staleness > 0 or engine != "transformers"


def _cpus_from_env() -> list[set[int]] | None:
    text = os.environ.get(CPUS_ENV, "").strip()
    if not text:
        return None
    return [{int(c) for c in part.split(",") if c.strip()} for part in text.split(";")]


class RolloutSession:
    def __init__(
        self, pipeline: RolloutPipeline, publisher=None, servers=None, client=None, remote=None
    ):
        self.pipeline, self.publisher = pipeline, publisher
        self.servers, self.client, self.remote = servers, client, remote
        self._reissued_seen = 0

    @classmethod
    def start(
        cls,
        job: RLFineTune,
        producer: Callable[[Any], Produce],
        engine: TransformersEngine,
        model: torch.nn.Module,
        cursor: Cursor,
        out: Path | None,
        log: Callable[[str], None],
        stopping: Callable[[], bool] = never,
    ) -> RolloutSession:
        """Rank 0's rollouts for `job`: `producer(engine)` sampling in process from
        `engine` (which shares `model`) or from rollout servers started here, drawing
        prompts and seeds from `cursor`'s streams. StopWaiting when `stopping()` turns
        true while the servers are awaited."""
        rollout, group_size = job.spec.rollout, job.spec.algorithm.group_size
        if not uses_servers(rollout):  # the synchronous loop, exactly
            from rlft.trainer.rollout.remote import SeededLikeAServer

            log(f"rlft: rollout engine transformers, in process ({choose_engine(rollout).reason})")

            produce = producer(SeededLikeAServer(engine))
            pipeline = RolloutPipeline(
                produce, cursor.rng, cursor.generator, 0, group_size, threaded=False
            )
            return cls(pipeline)
        stops = engine.stop_ids.tolist()
        urls = operator_instances()
        if urls:  # on Kubernetes: the instances the operator created, never our own
            session = cls._with_instances(job, producer, stops, model, cursor, urls, log, stopping)
            what = "operator-created"
        else:
            session = cls._with_servers(job, producer, stops, model, cursor, out, log, stopping)
            urls = session.servers.urls
            what = f"{session.servers.engine}; {choose_engine(rollout).reason}"
        log(
            f"rlft: {len(urls)} rollout server(s) ({what}) at "
            f"{', '.join(urls)}; maxStaleness {rollout.max_staleness}, "
            f"weights by {rollout.publication} via {session.publisher.store.storage.uri}"
        )
        return session

    @classmethod
    def _with_instances(
        cls, job, producer, stop_ids, model, cursor, urls, log, stopping
    ) -> RolloutSession:
        """Rollout instances started by someone else (the operator): wait until they
        answer, load the current weights into them through the store, then sample."""
        from rlft.trainer.checkpoint.factory import s3_options
        from rlft.trainer.rollout.client import RolloutClient
        from rlft.trainer.weights.store import WeightStore

        rollout = job.spec.rollout
        if not rollout.weights_uri:
            raise ValueError(
                "spec.rollout.weightsUri: rollout instances started elsewhere need a location "
                "both they and the trainer reach (the operator renders one under "
                "spec.checkpoint.uri)"
            )
        session = cls(None)  # type: ignore[arg-type]
        try:
            session.client = RolloutClient(
                urls, rollout.request_timeout_seconds, request_deadline(job)
            )
            session.client.wait_reachable(pods_start_within(job), log, stopping)
            store = WeightStore.at(rollout.weights_uri, s3=s3_options(job.spec.checkpoint))
            _go_on_after(_newest_published(store, session.client), cursor, log)
            session._connect(job, producer, stop_ids, cursor, store)
            session.publisher.publish_now(model, cursor.policy_version)
            session.client.wait_ready(rollout.request_timeout_seconds, stopping)
        except BaseException:
            session.close()
            raise
        return session

    @classmethod
    def _with_servers(
        cls, job, producer, stop_ids, model, cursor, out, log, stopping
    ) -> RolloutSession:
        from rlft.trainer.checkpoint.factory import s3_options
        from rlft.trainer.rollout.client import RolloutClient
        from rlft.trainer.rollout.local import LocalServers
        from rlft.trainer.weights.store import WeightStore, config_json, serialize

        rollout = job.spec.rollout
        base = out if out is not None else Path.cwd() / "runs" / job.metadata.name
        uri = rollout.weights_uri or (base.resolve() / "weights").as_uri()
        s3 = s3_options(job.spec.checkpoint)
        store = WeightStore.at(uri, s3=s3)
        # Its servers are new, but the store may hold an earlier run's later versions.
        _go_on_after(max(store.numbers(), default=None), cursor, log)
        version = cursor.policy_version
        store.write(version, serialize(model), config_json(model))  # servers start from it
        engine = local_engine(rollout)
        servers = LocalServers(
            rollout.instances, engine, uri, _cpus_from_env(), base, warn=log, s3=s3
        )
        session = cls(None, servers=servers)  # type: ignore[arg-type]
        try:
            session.client = RolloutClient(
                servers.start(),
                rollout.request_timeout_seconds,
                request_deadline(job),
                token=servers.token,
            )
            session.client.wait_ready(servers.startup_timeout_s, stopping)
            session._connect(job, producer, stop_ids, cursor, store)
            session.publisher.mark_acked(version)  # the servers started from the store
        except BaseException:
            session.close()
            raise
        return session

    def _connect(self, job, producer, stop_ids, cursor, store) -> None:
        """The publisher and the threaded pipeline over this session's client."""
        from rlft.trainer.rollout.publisher import WeightPublisher
        from rlft.trainer.rollout.remote import RemoteEngine

        rollout = job.spec.rollout
        timeout = rollout.request_timeout_seconds
        # Rollout instances refuse the weights of a gang older than one they heard from.
        self.publisher = WeightPublisher(
            self.client, store, rollout.publication, timeout, gang=operator_gang_attempt()
        )
        remote = RemoteEngine(self.client, stop_ids, rollout.request_prompts)
        self.remote = remote
        # The threaded pipeline draws ahead of the trainer from its own copies of the
        # streams; step_done points the cursor's (checkpointed) RNGs at the oldest batch
        # not yet trained on.
        self.pipeline = RolloutPipeline(
            producer(remote),
            cursor.rng,
            cursor.generator,
            rollout.max_staleness,
            job.spec.algorithm.group_size,
            threaded=True,
            wait_published=self.publisher.wait,
            tokens=lambda: remote.tokens,
        )

    def step_done(self, model: torch.nn.Module, cursor: Cursor) -> None:
        """After an optimizer step: ship the weights of the cursor's version (servers),
        release the next batch, and point the cursor's streams at the oldest batch not
        yet trained on (the threaded pipeline draws ahead; a resume regenerates what was
        in flight)."""
        if self.publisher is not None:
            self.publisher.publish(model, cursor.policy_version)
        self.pipeline.step_done(cursor.policy_version)
        if self.pipeline.threaded:
            cursor.set_streams(self.pipeline.state_dict())

    def rolled_back(self, model: torch.nn.Module, cursor: Cursor) -> None:
        """After a rollback: publish the restored weights as the cursor's (new) version and
        regenerate from the cursor (the oldest batch not trained on) with them, dropping
        what was generated or in flight. In process the engine already is the restored
        model."""
        if self.publisher is None:
            return
        version = cursor.policy_version
        self.pipeline.close()
        self.publisher.publish(model, version)
        self.pipeline = self.pipeline.restarted(cursor.rng, cursor.generator, version)

    def step_metrics(self, flow: dict[str, float], step_seconds: float) -> dict[str, float]:
        """The step's rollout figures for metrics.jsonl."""
        out = {k: v for k, v in flow.items() if k != "rollout_wait_s"}
        wait = flow.get("rollout_wait_s", 0.0)
        out["trainer_idle_ratio"] = wait / step_seconds if step_seconds > 0 else 0.0
        return out | self.metrics()

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.publisher is not None:
            out["weight_publish_s"] = self.publisher.last_publish_s
        if self.client is not None:
            total = self.client.reissued
            out["reissued_requests"] = float(total - self._reissued_seen)
            self._reissued_seen = total
            out["rollout_engines_healthy"] = float(len(self.client.live()))
            out["rollout_engines_expected"] = float(len(self.client.instances))
        return out

    def close(self) -> None:
        # The client first: the pipeline's thread, generating ahead, waits on requests
        # that end only when the client closes (the pipeline's join waited out its 5 s).
        if self.client is not None:
            self.client.close()
        if self.pipeline is not None:
            self.pipeline.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.servers is not None:
            self.servers.stop()


def _go_on_after(newest: int | None, cursor, log) -> None:
    """An earlier run of this job published past the checkpoint this one resumed (the
    instances or the store outlived it): those numbers name other weights, and versions
    only grow, so the instances, the store and the staleness gate never see one number
    for two sets of weights (a version rewritten in place kept its old READY meanwhile)."""
    if newest is not None and newest > cursor.policy_version:
        log(
            f"rlft: weights up to version {newest} were published before this run; "
            f"continuing at version {newest + 1} (versions only grow)"
        )
        cursor.policy_version = newest + 1


def _newest_published(store, client) -> int | None:
    """The highest version any weights were published under: in the store (ready or cut
    short) or loaded into an instance (a broadcast leaves none in the store)."""
    from rlft.trainer.rollout.client import ProtocolError, RequestFailed, http_json

    found = list(store.numbers())
    for instance in client.instances:
        # Read only: an instance started empty answers not-ok, and is still to be loaded.
        try:
            answer = http_json(f"{instance.url}/healthz", None, 5.0)
        except (RequestFailed, ProtocolError):
            continue
        if isinstance(answer, dict) and isinstance(answer.get("policy_version"), int):
            found.append(answer["policy_version"])
    return max(found, default=None)
