"""A newer trainer gang of a job fences out an older one still running (a node the
operator lost contact with, whose trainers were only cut off): through both backends
(a real SeaweedFS server and file://), the older gang's saves commit nothing once the
newer gang claimed the location, and it is told to stop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import batch_for, tiny_model, train_step

from rlft.trainer.checkpoint import load, open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.fence import Fence, SupersededError, claim_fence
from rlft.trainer.checkpoint.saver import Checkpointer

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _gang(storage, attempt: int) -> Checkpointer:
    fence = Fence(storage, "job-uid-1", attempt)
    fence.claim()
    return Checkpointer(storage, interval_steps=1, keep_last=3, job_uid="job-uid-1", fence=fence)


def test_an_older_gang_commits_nothing_once_a_newer_one_claimed(store) -> None:
    storage = store
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    old = _gang(storage, attempt=0)
    assert old.save(2, model, optimizer, extra={"step": 2}, wait=True)

    new = _gang(storage, attempt=1)  # the operator's replacement gang resumes step 2
    model2 = tiny_model(seed=3)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    assert load(storage, "auto", model2, optimizer2).step == 2
    train_step(model2, optimizer2, batch_for(3))
    new.descend_from(2)
    assert new.save(3, model2, optimizer2, extra={"step": 3}, wait=True)

    # The old gang, cut off but alive, trains on and reaches its own steps 3 and 4.
    train_step(model, optimizer, batch_for(3))
    assert not old.save(3, model, optimizer, extra={"step": 3}, wait=True)
    assert "replaced by attempt 1" in (old.superseded or "")
    scan = Catalog(storage).scan()
    assert scan.latest == 3 and 2 in scan.manifests  # the new gang's, its parent kept
    assert scan.manifests[3].parent == 2
    decision = old.poll(4)
    assert decision.stop and not decision.save and "attempt 1" in decision.superseded
    # The new gang's step-3 files are its own: the old gang wrote none over them.
    model3 = tiny_model(seed=5)
    assert load(storage, 3, model3, torch.optim.AdamW(model3.parameters(), lr=1e-2)).step == 3
    pairs = zip(model3.parameters(), model2.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    old.close()
    new.close()


def test_a_gang_older_than_the_claim_is_refused_at_its_start(store, monkeypatch) -> None:
    storage = store
    Fence(storage, "job-uid-1", 4).claim()
    monkeypatch.setenv("RLFT_JOB_UID", "job-uid-1")
    monkeypatch.setenv("RLFT_GANG_ATTEMPT", "3")
    with pytest.raises(SupersededError, match="attempt 3 was replaced by attempt 4"):
        claim_fence(storage, True, lambda value: value, retry_s=5)
    monkeypatch.setenv("RLFT_GANG_ATTEMPT", "5")
    assert claim_fence(storage, True, lambda value: value, retry_s=5).attempt == 5
    assert Fence(storage, "job-uid-1", 0).newest() == 5
    monkeypatch.delenv("RLFT_JOB_UID")  # a local run: no fence
    assert claim_fence(storage, True, lambda value: value, retry_s=5) is None


def superseded_on_two_ranks(rank: int, port: int, root: str) -> None:
    """Spawned per rank: a gang of 2 saves once, then a newer gang claims the location
    and the old gang's next save (its final one, waited for) must fail on both ranks
    alike, with no file of it written and the fence's word on both."""
    import json

    from checkpoint_fixtures import join_gloo_group, leave_gloo_group

    join_gloo_group(rank, 2, port)
    storage = open_storage(f"file://{root}/ckpts")
    fence = Fence(storage, "job-uid-2", 0)
    if rank == 0:
        fence.claim()
    ckpt = Checkpointer(storage, job_uid="job-uid-2", fence=fence)
    model = tiny_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = ckpt.save(2, model, optimizer, extra={"step": 2}, wait=True)
    torch.distributed.barrier()
    if rank == 0:
        Fence(storage, "job-uid-2", 1).claim()  # the newer gang
    torch.distributed.barrier()
    second = ckpt.save(4, model, optimizer, extra={"step": 4}, wait=True)
    said = ckpt.superseded or ""
    ckpt.close()
    Path(root, f"rank-{rank}.json").write_text(json.dumps([first, second, said]))
    leave_gloo_group()


def test_both_ranks_of_a_superseded_gang_stop_alike(tmp_path: Path) -> None:
    """Only rank 0 reads the fence: its word reached no other rank, which uploaded its
    shards anyway and, after a final save, went on alone into collectives."""
    import json

    import torch.multiprocessing as mp
    from seaweedfs import free_ports

    (port,) = free_ports(1)
    mp.spawn(superseded_on_two_ranks, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        first, second, said = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert first is True and second is False, rank
        assert "replaced by attempt 1" in said, (rank, said)
    assert not (tmp_path / "ckpts" / "step-000004").exists()  # no rank wrote a file
    assert Catalog(open_storage(f"file://{tmp_path}/ckpts")).scan().latest == 2
