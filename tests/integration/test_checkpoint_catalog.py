"""The catalog's choices over a file:// location, with manifests written by hand: what
retention deletes of damaged and newer-format folders, and when a resume refuses a
newer rlft's checkpoint. No model is saved: the rules, not the bytes, are under test."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rlft.trainer.checkpoint import open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.errors import NewerFormatError
from rlft.trainer.checkpoint.manifest import FileEntry, Manifest, config_hash, step_dir


def _manifest(step: int, healthy: bool = True) -> Manifest:
    return Manifest(
        step=step,
        policy_version=step,
        world_size=1,
        config_hash=config_hash({"run": 1}),
        healthy=healthy,
        files=(FileEntry("__0_0.distcp", 4, "00" * 32),),
    )


def _newer(step: int) -> bytes:
    doc = json.loads(_manifest(step).to_json())
    doc["formatVersion"] = 99
    return json.dumps(doc).encode()


def _steps(catalog: Catalog) -> set[int]:
    return {int(info.key[5:11]) for info in catalog.storage.list("") if info.key != "latest"}


def test_retention_deletes_damaged_and_interrupted_folders_but_not_a_newer_rlfts(
    tmp_path: Path,
) -> None:
    catalog = Catalog(open_storage(f"file://{tmp_path}"))
    storage = catalog.storage
    catalog.commit(_manifest(2))
    storage.put_bytes(f"{step_dir(3)}/manifest.json", b"{not json")  # damaged
    storage.put_bytes(f"{step_dir(4)}/__0_0.distcp", b"abcd")  # interrupted save
    storage.put_bytes(f"{step_dir(5)}/manifest.json", _newer(5))  # a newer rlft's
    catalog.commit(_manifest(6))
    scan = catalog.scan()
    assert set(scan.unreadable) == {3, 5} and scan.newer == {5} and scan.uncommitted == {4}

    assert catalog.prune(keep_last=5) == {3, 4}
    assert _steps(catalog) == {2, 5, 6}


def test_a_newer_rlfts_checkpoint_named_by_the_pointer_is_refused_not_passed_over(
    tmp_path: Path,
) -> None:
    """After a rollback to it, the newer rlft's checkpoint is `latest` though a readable
    one lies above it (the abandoned timeline): a resume must not fall back below it."""
    catalog = Catalog(open_storage(f"file://{tmp_path}"))
    catalog.commit(_manifest(2))
    catalog.commit(_manifest(6))
    catalog.storage.put_bytes(f"{step_dir(4)}/manifest.json", _newer(4))
    catalog.storage.put_bytes("latest", f"{step_dir(4)}\n".encode())

    def intact(manifest: Manifest) -> list[str]:
        return []

    for which in ("auto", "latest-healthy"):
        with pytest.raises(NewerFormatError, match="step-000004"):
            catalog.choose(which, check=intact)
    assert catalog.choose(2, check=intact).step == 2  # an older step, named


def test_the_catalog_lists_its_step_folders_not_the_history_and_outputs_beside_them(
    tmp_path: Path,
) -> None:
    # A weeks-long run keeps a history segment per checkpoint under metrics/: the scan
    # after every commit must not list (on S3: page through) all of them.
    catalog = Catalog(open_storage(f"file://{tmp_path}"))
    listed: list[str] = []
    real_list = catalog.storage.list

    def recording_list(prefix: str = "") -> list:
        listed.append(prefix)
        return real_list(prefix)

    catalog.storage.list = recording_list  # type: ignore[method-assign]
    for step in range(1, 30):
        catalog.storage.put_bytes(f"metrics/{step_dir(step)}-0a.jsonl", b"{}\n")
    catalog.storage.put_bytes("outputs/summary.json", b"{}")
    catalog.commit(_manifest(2))
    catalog.commit(_manifest(4))
    assert sorted(catalog.scan().manifests) == [2, 4]
    assert catalog.prune(keep_last=1) == {2}
    assert listed and all(prefix.startswith("step-") for prefix in listed), listed


def test_the_listing_marks_the_steps_off_the_timeline_and_retention_deletes_them(
    tmp_path: Path,
) -> None:
    """An earlier run's 55 and 70 after `--resume 50` committed 60 (its parent 50):
    `rlft checkpoints list` says they are abandoned, and the next retention deletes them
    (70 is above `latest`; 55 is between 60 and its parent)."""
    uri = f"file://{tmp_path}/ckpts"
    catalog = Catalog(open_storage(uri))
    for step, parent in ((40, None), (50, 40), (55, 50), (70, 55), (60, 50)):
        catalog.commit(replace(_manifest(step), parent=parent))
    listing = subprocess.run(
        [sys.executable, "-m", "rlft.trainer.cli.main", "checkpoints", "list", uri],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    notes = {int(line.split()[0]): line.split()[5:] for line in listing.splitlines()[1:]}
    assert notes == {40: [], 50: [], 55: ["abandoned"], 60: ["latest"], 70: ["abandoned"]}
    assert catalog.prune(keep_last=3) == {55, 70}
    assert _steps(catalog) == {40, 50, 60}
