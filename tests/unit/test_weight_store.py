"""The weight store's retention: which published versions stay readable."""

from __future__ import annotations

from pathlib import Path

from rlft.trainer.weights.store import READY, WeightStore, version_key


def store_at(tmp_path: Path, keep: int = 3) -> WeightStore:
    return WeightStore.at((tmp_path / "weights").as_uri(), keep)


def test_a_sparse_version_stays_until_keep_newer_ones_are_ready(tmp_path: Path) -> None:
    """In broadcast mode a store copy is written only when the group is re-formed, so
    version numbers in the store are far apart. An instance that started from LATEST
    (5) may still be loading it when the next copy (10) is written: 5 must stay until
    `keep` newer versions are ready, not go because its number is `keep` behind."""
    store = store_at(tmp_path, keep=3)
    store.write(5, b"weights of 5", "{}")
    store.write(10, b"weights of 10", "{}")
    assert store.versions() == [5, 10]
    assert store.storage.exists(f"{version_key(5)}/{READY}")
    store.write(11, b"weights of 11", "{}")
    store.write(12, b"weights of 12", "{}")
    assert store.versions() == [10, 11, 12]  # 5 went once 3 newer ones were ready


def test_a_cut_short_folder_below_the_kept_versions_is_removed(tmp_path: Path) -> None:
    """A folder without READY older than every kept version is removed with them."""
    store = store_at(tmp_path, keep=2)
    store.write(1, b"1", "{}")
    store.storage.put_bytes(f"{version_key(2)}/config.json", b"{}")  # cut short
    store.write(7, b"7", "{}")
    assert store.numbers() == [1, 2, 7]  # 1 is kept (1 newer ready), 2 above it stays
    store.write(9, b"9", "{}")
    assert store.numbers() == [7, 9]


def test_versions_above_the_one_written_are_left_alone(tmp_path: Path) -> None:
    """A version written below others (a local run resumed from an older checkpoint)
    is never pruned by them."""
    store = store_at(tmp_path, keep=2)
    for version in (20, 21, 22):
        store.write(version, b"old", "{}")
    store.write(3, b"new", "{}")
    assert 3 in store.versions()
    assert store.latest() == 3
