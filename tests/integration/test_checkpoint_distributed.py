"""Sharded checkpoints of an FSDP2 model in a real 2-process gloo group, saved to a
real SeaweedFS server: exact resume at world size 2, and loading at world size 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from checkpoint_fixtures import (
    batch_for,
    distributed_save_and_resume,
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
