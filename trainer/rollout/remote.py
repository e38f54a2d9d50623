"""Rollout instances behind the same `generate` call as the in-process engine, so the
orchestrator's `sample_and_score` and `collect` run unchanged against either."""

from __future__ import annotations

import math
import threading
import uuid

import torch

from rlft.trainer.rollout.client import RolloutClient
from rlft.trainer.rollout.engine import Completion, SamplingParams
from rlft.trainer.rollout.protocol import GenerateRequest


def request_seed(generator: torch.Generator | None) -> int:
    """The seed of one generate request, drawn from the orchestrator's generator."""
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


class SeededLikeAServer:
    """The in-process engine sampling from the seed one rollout server would be sent for
    the same call (a server seeds a fresh generator with it), so a synchronous run gives
    the same completions with or without a rollout server."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Completion]:
        seeded = torch.Generator().manual_seed(request_seed(generator))
        return self.engine.generate(prompts, n, sampling, seeded)


class RemoteEngine:
    def __init__(self, client: RolloutClient, stop_ids: list[int], request_prompts: int = 0):
        self.client = client
        self.stop_ids = list(stop_ids)
        self.request_prompts = request_prompts
        self._lock = threading.Lock()
        self.tokens = 0
        """Completion tokens generated (cumulative)."""
        self.engine_seconds = 0.0
        """Time the instances spent generating them (summed over requests)."""

    def _chunks(self, count: int) -> list[tuple[int, int]]:
        """Slices of the prompts, one request (and seed) each. Cut by how many instances
        the job has, not by how many answer now: the samples must not depend on which are
        up (a request meant for a down one is sent to another, with its seed)."""
        size = self.request_prompts or math.ceil(count / max(1, len(self.client.instances)))
        return [(start, min(count, start + size)) for start in range(0, count, size)]

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt, grouped by prompt, from requests spread over the
        instances; each request is seeded from `generator` (reproducible given its state)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        base = request_seed(generator)
        chunks = self._chunks(len(prompts))
        futures = [
            self.client.submit(
                GenerateRequest(
                    prompts=prompts[start:end],
                    n=n,
                    sampling=sampling,
                    seed=(base + k) % 2**62,
                    request_id=uuid.uuid4().hex,
                    stop_ids=self.stop_ids,
                )
            )
            for k, (start, end) in enumerate(chunks)
        ]
        out: list[Completion] = []
        for (start, _), future in zip(chunks, futures, strict=True):
            answer = future.result()
            with self._lock:
                self.tokens += answer.tokens
                self.engine_seconds += answer.seconds
            for c in answer.completions:
                c.prompt_index += start
                out.append(c)
        return out
