"""Sharded checkpoints of an FSDP2 model in a real 2-process gloo group, saved to a
real SeaweedFS server: exact resume at world size 2, and loading at world size 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from checkpoint_fixtures import (
    batch_for,
    corrupt,
    distributed_save_and_resume,
    join_gloo_group,
    leave_gloo_group,
    params_of,
    s3_options,
    tiny_model,
    train_step,
)
from seaweedfs import free_ports

from rlft.trainer.checkpoint import load, open_storage
from rlft.trainer.checkpoint.catalog import Catalog

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_fsdp2_sharded_save_resumes_at_world_size_2_and_1(s3_env, bucket, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/fsdp"
    (port,) = free_ports(1)
    mp.spawn(
        distributed_save_and_resume,
        args=(2, uri, s3_env.endpoint, port, str(tmp_path)),
        nprocs=2,
        join=True,
    )
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()

    storage = open_storage(uri, s3_options(s3_env))
    manifest = Catalog(storage).scan().manifests[2]
    assert manifest.world_size == 2
    shards = sorted(e.path for e in manifest.files if e.path.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own part

    reference = torch.load(tmp_path / "reference.pt")
    model = tiny_model(seed=9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed = load(storage, "auto", model, optimizer)
    assert resumed.step == 2 and resumed.rank_state is None and not resumed.rng_restored
    for name, value in params_of(model).items():
        assert torch.equal(value, reference["two"][name]), name  # resharding is exact
    train_step(model, optimizer, batch_for(3), mask=False)
    for name, value in params_of(model).items():
        torch.testing.assert_close(value, reference["three"][name], rtol=1e-5, atol=1e-6)


def test_each_rank_reads_only_the_pieces_of_the_checkpoint_it_loads(
    s3_env, bucket, tmp_path: Path
) -> None:
    """Whole shard files made each of N ranks download the whole checkpoint (N times its
    size from the store). With the manifest's per-piece checksums (4 KiB pieces here),
    each rank fetches the pieces its load plan reads, and still resumes exactly."""
    uri = f"s3://{bucket}/ranged"
    (port,) = free_ports(1)
    mp.spawn(
        distributed_save_and_resume,
        args=(2, uri, s3_env.endpoint, port, str(tmp_path), 4096),
        nprocs=2,
        join=True,
    )
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()  # exact resume
    manifest = Catalog(open_storage(uri, s3_options(s3_env))).scan().manifests[2]
    assert manifest.block_bytes == 4096
    shards = [e for e in manifest.files if e.path.endswith(".distcp")]
    assert all(len(e.blocks) == -(-e.size // 4096) for e in shards)
    total = manifest.total_bytes
    read = [int((tmp_path / f"read-{rank}").read_text()) for rank in (0, 1)]
    # each rank: its half of the shards, the pieces of the small replicated values, and
    # the side files; not the whole checkpoint
    assert all(r < 0.75 * total for r in read), (read, total)


def damaged_on_two_ranks(rank: int, port: int, root: str) -> None:
    """Spawned per rank: a file:// checkpoint at world size 2 whose file in rank 1's
    share of the checksum work is damaged; both ranks try to resume from it."""

    import torch.distributed as dist

    from rlft.trainer.checkpoint.errors import DamagedCheckpointsError
    from rlft.trainer.checkpoint.saver import Checkpointer

    join_gloo_group(rank, 2, port)
    storage = open_storage(f"file://{root}/ckpts")
    model = tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(storage)
    assert ckpt.save(2, model, optimizer, extra={"step": 2}, wait=True)
    ckpt.close()
    if rank == 0:
        manifest = Catalog(storage).scan().manifests[2]
        victim = manifest.files[1].path  # checked by rank 1 (files[rank::world_size])
        corrupt(storage, f"step-000002/{victim}")
        Path(root, "victim").write_text(victim)
    dist.barrier()
    try:
        load(storage, "auto", model, optimizer)
    except DamagedCheckpointsError as error:
        Path(root, f"error-{rank}").write_text(str(error))
    leave_gloo_group()


def test_a_file_damaged_in_another_ranks_share_is_named_on_every_rank(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    mp.spawn(damaged_on_two_ranks, args=(port, str(tmp_path)), nprocs=2, join=True)
    victim = (tmp_path / "victim").read_text()
    for rank in (0, 1):
        error = (tmp_path / f"error-{rank}").read_text()
        assert f"step-000002: {victim}: checksum mismatch" in error, error


def flaky_on_rank_1(rank: int, port: int, root: str, uri: str, endpoints: list[str]) -> None:
    """Spawned per rank: a save on 2 ranks where rank 1's store (behind the test's proxy)
    refuses one upload with a 503 (a transient error, retried); rank 0 records the events
    it gets."""
    import json

    from rlft.trainer.checkpoint.saver import Checkpointer
    from rlft.trainer.storage.backends import S3Options

    join_gloo_group(rank, 2, port)
    # Rank 1 without botocore's own retries: the refusal reaches the saver's.
    options = S3Options(
        endpoint_url=endpoints[rank], addressing_style="path", max_attempts=0 if rank else 3
    )
    storage = open_storage(uri, options)
    events: list[list] = []
    ckpt = Checkpointer(storage, on_event=lambda name, info: events.append([name, info]))
    model = tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert ckpt.save(2, model, optimizer, extra={"step": 2}, wait=True)
    ckpt.close()
    Path(root, f"events-{rank}.json").write_text(json.dumps(events))
    leave_gloo_group()


def test_another_ranks_upload_retries_reach_rank_0(
    tmp_path: Path, s3_env, bucket, store_proxy
) -> None:
    """Each rank uploads its own shards; only rank 0 has telemetry, and it counted only
    its own retries: a store throttling the other ranks was invisible."""
    import json

    (port,) = free_ports(1)
    store_proxy.refuse("/ckpts/", times=1)
    endpoints = [s3_env.endpoint, store_proxy.url]  # rank 1 alone behind the proxy
    uri = f"s3://{bucket}/ckpts"
    mp.spawn(flaky_on_rank_1, args=(port, str(tmp_path), uri, endpoints), nprocs=2, join=True)
    assert len(store_proxy.held_paths) == 1
    events = json.loads((tmp_path / "events-0.json").read_text())
    peers = [info for name, info in events if name == "peer_retries"]
    assert peers == [{"step": 2, "count": 1}], events
    assert [name for name, _ in events].count("committed") == 1
