"""Stage folders (trainer/checkpoint/staging.py) between real processes: a killed
process's stage is removed by the next one to start, a live process's is never touched,
and nothing but stages is removed from a user's staging folder; the default staging
folders of other locations (in the temporary directory) are swept the same way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from checkpoint_fixtures import s3_options

from rlft.trainer.checkpoint import open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.saver import Checkpointer
from rlft.trainer.checkpoint.staging import Stage, remove_abandoned

HOLDER = """
import sys, time
from pathlib import Path
from rlft.trainer.checkpoint.staging import Stage
stage = Stage(Path(sys.argv[1]), int(sys.argv[2]))
(stage.folder / "step-000004").mkdir()
(stage.folder / "step-000004" / "__0_0.distcp").write_bytes(b"half a shard")
print(stage.folder, flush=True)
time.sleep(600)
"""


def hold(parent: Path, rank: int) -> tuple[subprocess.Popen, Path]:
    """A process holding a stage with a save in it; returns it and its stage folder."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(parent), str(rank)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    return process, Path(process.stdout.readline().strip())


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_stages_of_killed_processes_go_and_live_ones_stay(tmp_path: Path) -> None:
    parent = tmp_path / "staging"
    (parent / "notes").mkdir(parents=True)  # the user's own: not a stage
    (parent / "rank-x").mkdir()
    live, live_folder = hold(parent, 0)
    killed, killed_folder = hold(parent, 3)  # a rank a smaller world no longer has
    try:
        assert live_folder == parent / "rank-0"
        stop(killed)
        assert (killed_folder / "step-000004" / "__0_0.distcp").exists()

        # Rank 0 again, while the live process holds rank-0: a folder of its own.
        stage = Stage(parent, 0)
        assert stage.folder == parent / f"rank-0-{os.getpid()}"
        assert (live_folder / "step-000004" / "__0_0.distcp").read_bytes() == b"half a shard"
        assert not killed_folder.exists()
        assert (parent / "notes").is_dir() and (parent / "rank-x").is_dir()
        (stage.folder / "step-000006").mkdir()
        stage.release(remove_parent=True)
        assert not stage.folder.exists() and parent.is_dir()  # others' things still there
        stage.release(remove_parent=True)  # twice is harmless
    finally:
        stop(live)
        stop(killed)

    # With the holder gone its stage is stale, and the new rank 0 takes its place.
    stage = Stage(parent, 0)
    assert stage.folder == parent / "rank-0"
    assert list(stage.folder.iterdir()) == [stage.folder / ".lock"]
    stage.release(remove_parent=False)
    assert sorted(p.name for p in parent.iterdir()) == ["notes", "rank-x"]


def test_abandoned_default_stages_of_other_locations_go(tmp_path: Path) -> None:
    """A run killed mid-save whose location never runs again: its stage in the default
    staging folder goes when any other location's checkpointer starts."""
    root = tmp_path / "tmp"
    abandoned = root / "rlft-staging-0123456789ab"
    killed, killed_folder = hold(abandoned, 0)
    live, live_folder = hold(root / "rlft-staging-ba9876543210", 1)
    shared = root / "rlft-staging-aaaaaaaaaaaa"  # a stale stage beside something else
    (shared / "rank-2").mkdir(parents=True)
    (shared / "notes").write_text("mine")
    not_default = root / "rlft-staging-mine" / "rank-0"  # not a default staging folder
    not_default.mkdir(parents=True)
    own = root / "rlft-staging-cccccccccccc"
    stage = Stage(own, 0)
    try:
        stop(killed)
        assert (killed_folder / "step-000004" / "__0_0.distcp").exists()
        remove_abandoned(root, keep=own)
        assert not abandoned.exists()  # the stage and then its emptied folder
        assert (live_folder / "step-000004" / "__0_0.distcp").read_bytes() == b"half a shard"
        assert not (shared / "rank-2").exists() and (shared / "notes").read_text() == "mine"
        assert not_default.is_dir() and stage.folder.is_dir()
    finally:
        stop(live)
        stage.release(remove_parent=True)


def test_an_object_store_checkpointer_sweeps_abandoned_stages(
    tmp_path: Path, monkeypatch, s3_env, bucket
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_folder = hold(tmp_path / "rlft-staging-0123456789ab", 0)
    stop(killed)
    checkpointer = Checkpointer(open_storage(f"s3://{bucket}/run", s3_options(s3_env)))
    try:
        assert checkpointer.staging_dir.parent.parent == tmp_path
        assert not killed_folder.parent.exists()
    finally:
        checkpointer.close()
    assert not any(tmp_path.glob("rlft-staging-*"))  # its own went at close


@pytest.fixture
def bind_mount(tmp_path: Path):
    """`tmp_path/mnt`: a bind mount of `tmp_path/disk`, on the device of `tmp_path`."""
    source, mount = tmp_path / "disk", tmp_path / "mnt"
    source.mkdir()
    mount.mkdir()
    done = subprocess.run(["mount", "--bind", str(source), str(mount)], capture_output=True)
    assert done.returncode == 0, (
        "the bind-mount test needs root (CI and the dev machines run as root): "
        f"{done.stderr.decode().strip()}"
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_staging_folder_on_another_mount_of_the_same_disk_is_copied_from(
    bind_mount: Path, tmp_path: Path
) -> None:
    """A file:// location and spec.checkpoint.stagingDir on one device but two mounts (a
    bind mount, a pod's two volumes of one disk): the same device number, so the upload
    renamed, and the kernel refuses a rename across mounts (EXDEV). Every checkpoint
    failed, for good."""
    import torch
    from checkpoint_fixtures import tiny_model

    stage = tmp_path / "stage"
    stage.mkdir()
    assert os.stat(stage).st_dev == os.stat(bind_mount).st_dev
    storage = open_storage(f"file://{bind_mount}/ckpts")
    model = tiny_model()
    ckpt = Checkpointer(storage, staging_dir=stage)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        assert ckpt.save(1, model, optimizer, extra={"step": 1}, wait=True)
    finally:
        ckpt.close()
    scan = Catalog(storage).scan()
    assert scan.latest == 1 and Catalog(storage).verify(scan.manifests[1]) == []
    assert not any(p.is_file() for p in stage.rglob("*"))  # the stage went
