"""Shared pieces of the checkpoint tests: a tiny transformers model, its training step,
the SeaweedFS fixtures, and the worker process that the fault tests start, signal and
kill (`python checkpoint_fixtures.py worker …`)."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from seaweedfs import ACCESS_KEY, SECRET_KEY, SeaweedServer

HERE = Path(__file__).resolve()
VOCAB = 300


@contextlib.contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's -o size=) at `mount`: writes beyond it fail with
    ENOSPC, as on a full volume. Needs root (CI and the dev machines run as root)."""
    import subprocess

    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    )
    assert done.returncode == 0, f"mounting a {size} tmpfs: {done.stderr.decode().strip()}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def tiny_model(seed: int = 0, config=None):
    from transformers import AutoModelForCausalLM

    from rlft.trainer.model.construct import from_config

    torch.manual_seed(seed)
    return from_config(AutoModelForCausalLM, config or tiny_config())


def batch_for(step: int, rows: int = 4, length: int = 16) -> torch.Tensor:
    """The global batch of a step: a function of the step only (a data cursor)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (rows, length), generator=generator)


def train_step(model, optimizer, tokens: torch.Tensor, mask: bool = True) -> float:
    """One optimizer step; a random dropout-like mask makes the global RNG matter."""
    labels = tokens
    if mask:
        labels = tokens.masked_fill(torch.rand(tokens.shape) < 0.1, -100)
    loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def corrupt(storage, key: str) -> None:
    """Flip one byte in the middle of the stored object `key` (size unchanged)."""
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    storage.put_bytes(key, bytes(data))


def params_of(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of the parameters."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


# ----------------------------------------------------------------------- SeaweedFS


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> Iterator[SeaweedServer]:
    """One real SeaweedFS server (S3 API on loopback) for the session."""
    root = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedServer(root / "data", root / "weed.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(monkeypatch, seaweed) -> SeaweedServer:
    """The test's credentials in the standard AWS environment."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    return seaweed


_buckets = iter(range(10**6))


@pytest.fixture(params=["s3", "file"])
def store(request, tmp_path: Path):
    """An empty location on each backend: a real SeaweedFS bucket, a local folder."""
    from rlft.trainer.storage.backends import open_storage

    if request.param == "file":
        return open_storage(f"file://{tmp_path}/ckpts")
    server = request.getfixturevalue("s3_env")
    bucket = request.getfixturevalue("bucket")
    return open_storage(f"s3://{bucket}/run-a", s3_options(server))


@pytest.fixture
def bucket(s3_env) -> str:
    """A fresh bucket on the session's server."""
    name = f"ckpt-{os.getpid()}-{next(_buckets)}"
    s3_env.create_bucket(name)
    return name


@pytest.fixture
def store_proxy(s3_env):
    """A pass-through proxy in front of the session's server (s3_proxy.py) that a test
    tells to hold, refuse or deny requests; stopped after the test."""
    from s3_proxy import S3Proxy

    proxy = S3Proxy(s3_env.endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


def s3_options(server: SeaweedServer, **overrides):
    from rlft.trainer.storage.backends import S3Options

    settings = dict(endpoint_url=server.endpoint, addressing_style="path", part_size_mb=5)
    settings.update(overrides)
    return S3Options(**settings)


# ------------------------------------------------------------ distributed (FSDP2)


def fsdp_model(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model()
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def local_rows(tokens: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return tokens[rank::world_size]


class CountingReads:
    """A store that counts the bytes read from it (whole files and ranges)."""

    def __init__(self, inner: Any):
        self.inner, self.read = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_file(self, key: str, path: Path) -> None:
        self.inner.get_file(key, path)
        self.read += path.stat().st_size

    def get_range(self, key: str, start: int, length: int) -> bytes:
        data = self.inner.get_range(key, start, length)
        self.read += len(data)
        return data


def join_gloo_group(rank: int, world_size: int, port: int) -> None:
    """Start of a rank spawned by `mp.spawn`: one thread, a gloo group on loopback, and
    a native crash reported with every thread's Python stack (mp.spawn names only the
    signal)."""
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def leave_gloo_group() -> None:
    """End of a rank spawned by `mp.spawn`, as a trainer rank ends: every rank done with
    the group before it goes, then no interpreter finalization. Finalization destroys the
    groups FSDP's device meshes still hold with gloo's threads attached, and a rank
    aborted there ("terminate called without an active exception", SIGABRT) in one CI
    run of test_fsdp2_sharded_save_resumes_at_world_size_2_and_1."""
    from rlft.trainer.distributed.runtime import exit_worker, shutdown

    shutdown()
    exit_worker(0)


def distributed_save_and_resume(
    rank: int,
    world_size: int,
    uri: str,
    endpoint: str,
    port: int,
    out: str,
    block_bytes: int = 64 * 2**20,
) -> None:
    """Spawned per rank: FSDP2 training, an async sharded save at step 2, one more step;
    then a fresh FSDP2 model resumes from the checkpoint and must redo step 3 exactly.
    Writes the bytes each rank's resume read from the store to `read-<rank>`."""

    from rlft.trainer.checkpoint import load, open_storage
    from rlft.trainer.checkpoint.export import hf_files_of
    from rlft.trainer.checkpoint.saver import Checkpointer
    from rlft.trainer.storage.backends import S3Options

    join_gloo_group(rank, world_size, port)
    options = S3Options(endpoint_url=endpoint, addressing_style="path", part_size_mb=5)
    storage = open_storage(uri, options)
    model, optimizer = fsdp_model(world_size)
    ckpt = Checkpointer(
        storage, interval_steps=2, hf_files=hf_files_of(model), block_bytes=block_bytes
    )
    for step in (1, 2):
        train_step(model, optimizer, local_rows(batch_for(step), rank, world_size), mask=False)
        decision = ckpt.poll(step)
    assert decision.save
    at_two = params_of(model)
    ckpt.save(2, model, optimizer, extra={"step": 2}, rank_state={"rank": rank})
    train_step(model, optimizer, local_rows(batch_for(3), rank, world_size), mask=False)
    at_three = params_of(model)
    ckpt.close()
    assert ckpt.stats.committed == 1, ckpt.stats
    if rank == 0:
        torch.save({"two": at_two, "three": at_three}, Path(out) / "reference.pt")

    model2, optimizer2 = fsdp_model(world_size)
    counting = CountingReads(storage)
    resumed = load(counting, "auto", model2, optimizer2)
    (Path(out) / f"read-{rank}").write_text(str(counting.read))
    assert resumed.step == 2 and resumed.rank_state == {"rank": rank}
    train_step(model2, optimizer2, local_rows(batch_for(3), rank, world_size), mask=False)
    for name, value in params_of(model2).items():
        assert torch.equal(value, at_three[name]), f"rank {rank}: {name} differs after resume"
    (Path(out) / f"ok-{rank}").write_text("resumed exactly")
    leave_gloo_group()


# -------------------------------------------------------------------- the worker


def worker_command(uri: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE), "worker", uri, *args]


def worker_env(endpoint: str | None = None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    if endpoint:
        env["RLFT_TEST_ENDPOINT"] = endpoint
    return env


def _worker(argv: list[str]) -> int:
    """A small training loop with checkpoints: prints `STEP n`, `SAVED n`, `COMMITTED n`
    lines. `--slow-upload S` stalls S seconds after each stored file (to be killed mid-upload);
    `--grace G` installs the SIGTERM handler."""
    from rlft.trainer.checkpoint import GracefulStop, load, open_storage
    from rlft.trainer.checkpoint.errors import NoCheckpointError
    from rlft.trainer.checkpoint.export import hf_files_of
    from rlft.trainer.checkpoint.saver import Checkpointer

    parser = argparse.ArgumentParser()
    parser.add_argument("uri")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--slow-upload", type=float, default=0.0)
    parser.add_argument("--slow-from-step", type=int, default=0)
    parser.add_argument("--grace", type=float, default=0.0)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
    torch.set_num_threads(1)

    from rlft.trainer.storage.backends import S3Options

    endpoint = os.environ.get("RLFT_TEST_ENDPOINT")
    options = S3Options(endpoint_url=endpoint, addressing_style="path") if endpoint else None
    storage = open_storage(args.uri, options)
    if args.slow_upload:
        put_file = storage.put_file

        def slow_put_file(key, path, *, move=False):
            put_file(key, path, move=move)
            if int(key.split("/")[0].removeprefix("step-")) >= args.slow_from_step:
                print(f"UPLOADED {key}", flush=True)
                time.sleep(args.slow_upload)  # the upload stalls after storing a file

        storage.put_file = slow_put_file

    stop = GracefulStop(args.grace).install() if args.grace else None
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(
        storage,
        interval_steps=args.every,
        interval_minutes=1e6,
        keep_last=10,
        hf_files=hf_files_of(model),
        on_event=lambda name, info: print(f"EVENT {name} {info.get('step')}", flush=True),
    )
    start = 0
    with contextlib.suppress(NoCheckpointError):
        start = load(storage, "auto", model, optimizer).step
    for step in range(start + 1, args.steps + 1):
        loss = train_step(model, optimizer, batch_for(step))
        time.sleep(args.step_seconds)
        print(f"STEP {step} {loss:.6f}", flush=True)
        decision = ckpt.poll(step, stop.requested if stop else False)
        if decision.save:
            t0 = time.monotonic()
            committed = ckpt.save(
                step,
                model,
                optimizer,
                extra={"step": step},
                wait=decision.stop,
                emergency=decision.stop,
                retry_seconds=stop.remaining() if decision.stop else None,
            )
            print(f"SAVED {step} {time.monotonic() - t0:.3f} {committed}", flush=True)
        if decision.stop:
            ckpt.close()
            print(json.dumps({"stopped_at": step, "committed": committed}), flush=True)
            return 0
    ckpt.close()
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(sys.argv[2:]))
