"""Tiny models and rollout servers for the rollout tests (real HTTP servers on loopback)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rlft.trainer.config import ModelInit, ModelSpec, TokenizerSpec
from rlft.trainer.model.build import build_policy
from rlft.trainer.rollout.client import RolloutClient, http_json
from rlft.trainer.rollout.local import LocalServers
from rlft.trainer.rollout.publisher import WeightPublisher
from rlft.trainer.rollout.server import start_server
from rlft.trainer.storage.backends import S3Options
from rlft.trainer.weights.store import WeightStore, config_json, serialize

PROMPTS = [[40, 41, 42, 43, 44], [17], [100, 7, 250, 9, 31, 77, 5, 200]]


def tiny_model(family: str = "qwen3", seed: int = 0):
    """A random model whose greedy output is not trivial (weights re-drawn with a larger
    spread). head_dim 32: the smallest vLLM's CPU attention supports."""
    spec = ModelSpec(
        init=ModelInit(
            family=family,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            num_experts=4,
            experts_per_token=2,
            moe_intermediate_size=16,
            max_position_embeddings=64,
        ),
        tokenizer=TokenizerSpec(kind="byte"),
    )
    model, tokenizer = build_policy(spec, corpus=[], seed=0)
    redraw(model, seed)
    return model.eval(), tokenizer


def redraw(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)


def publish(store: WeightStore, model, version: int) -> str:
    return store.write(version, serialize(model), config_json(model))


class ThreadServer:
    """A rollout server on a thread of this process (transformers engine); `s3`: how it
    reaches published versions on S3 (as `rlft rollout` gets them from the job or flags);
    `port`: another's, to stand for it restarted (0: a free one)."""

    def __init__(
        self,
        kind: str = "transformers",
        token: str | None = None,
        s3: S3Options | None = None,
        port: int = 0,
    ):
        self.server = start_server(kind, port=port, token=token, s3=s3)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def servers_at_version_0(tmp_path: Path, count: int = 2):
    """(model, tokenizer, store, servers): `count` ThreadServers that loaded version 0 of
    a store in `tmp_path`; the caller stops them."""
    model, tokenizer = tiny_model()
    store = store_at(tmp_path)
    uri = publish(store, model, 0)
    servers = [ThreadServer() for _ in range(count)]
    for server in servers:
        http_json(f"{server.url}/weights", {"version": 0, "uri": uri}, 60)
    return model, tokenizer, store, servers


def store_at(tmp_path: Path) -> WeightStore:
    return WeightStore.at((tmp_path / "weights").as_uri())


def reading_through(proxy_url: str) -> S3Options:
    """How a rollout server reads the store through a test's S3Proxy: one attempt per
    request (botocore's max_attempts counts retries), so each request the proxy refuses
    fails the load it belongs to, as a store down past botocore's retries does."""
    return S3Options(endpoint_url=proxy_url, addressing_style="path", max_attempts=0)


@contextlib.contextmanager
def broadcasting(tmp_path: Path, count: int = 2) -> Iterator[tuple]:
    """(model, store, servers, client, publisher): `count` local transformers servers
    started from version 0 of a store, ready, with a client and a broadcast publisher over
    them; all closed after."""
    model, _ = tiny_model()
    store = store_at(tmp_path)
    publish(store, model, 0)
    with LocalServers(count, "transformers", store.storage.uri, log_dir=tmp_path) as servers:
        client = RolloutClient(
            servers.start(), timeout_s=60, probe_every_s=0.2, token=servers.token
        )
        publisher = WeightPublisher(client, store, "broadcast", timeout_s=60)
        try:
            client.wait_ready(120)
            yield model, store, servers, client, publisher
        finally:
            publisher.close()
            client.close()


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.02)
