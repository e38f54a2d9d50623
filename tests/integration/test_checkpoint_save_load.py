"""Saving and resuming through both backends (a real SeaweedFS server and file://):
exact resume, checksum fallback, retention, rollback timelines, the CLI and export."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import (
    batch_for,
    corrupt,
    params_of,
    s3_options,
    tiny_model,
    tmpfs,
    train_step,
)

from rlft.trainer.checkpoint import load, open_storage
from rlft.trainer.checkpoint.catalog import Catalog
from rlft.trainer.checkpoint.errors import (
    CheckpointError,
    CredentialsError,
    DamagedCheckpointsError,
    NewerFormatError,
    NoCheckpointError,
    StorageError,
    StorageFullError,
)
from rlft.trainer.checkpoint.export import hf_files_of
from rlft.trainer.checkpoint.saver import Checkpointer
from rlft.trainer.cli.main import main as rlft

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(params=["s3", "file"])
def location(request, tmp_path: Path) -> tuple[str, object]:
    """(URI, S3 options or None) of an empty checkpoint location."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpts", None
    server = request.getfixturevalue("s3_env")
    bucket = request.getfixturevalue("bucket")
    return f"s3://{bucket}/run", s3_options(server)


def _cli_flags(options) -> list[str]:
    """The `rlft checkpoints` flags that reach the location (S3: the test server)."""
    if options is None:
        return []
    return ["--endpoint-url", options.endpoint_url, "--addressing-style", "path"]


def _fresh(seed: int = 0):
    model = tiny_model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_async_save_then_exact_resume(location) -> None:
    uri, options = location
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, interval_steps=2, keep_last=5, hf_files=hf_files_of(model))
    for step in (1, 2):
        train_step(model, optimizer, batch_for(step))
        assert ckpt.poll(step).save is (step == 2)
    saved = params_of(model)
    ckpt.save(2, model, optimizer, extra={"step": 2, "cursor": [2, "x"]}, rank_state={"r": 0})
    # Training goes on while the checkpoint is written and uploaded; the snapshot must
    # not see these updates.
    after = [train_step(model, optimizer, batch_for(step)) for step in (3, 4)]
    expected = params_of(model)
    assert ckpt.wait(timeout=60)
    assert ckpt.stats.committed == 1 and ckpt.stats.last_step == 2
    assert ckpt.stats.last_blocking_s < ckpt.stats.last_total_s

    torch.manual_seed(12345)  # the resume must restore the RNG, whatever it is now
    model2, optimizer2 = _fresh(seed=7)
    resumed = load(storage, "auto", model2, optimizer2)
    assert (resumed.step, resumed.extra, resumed.rank_state) == (
        2,
        {"step": 2, "cursor": [2, "x"]},
        {"r": 0},
    )
    assert resumed.rng_restored
    for name, value in params_of(model2).items():
        assert torch.equal(value, saved[name]), name
    again = [train_step(model2, optimizer2, batch_for(step)) for step in (3, 4)]
    assert again == after  # bit-identical losses…
    for name, value in params_of(model2).items():
        assert torch.equal(value, expected[name]), name  # …and parameters
    assert ckpt.staging_dir.is_dir()
    ckpt.close()
    # Nothing staged stays behind on the trainer's disk.
    assert not ckpt.staging_dir.parent.exists()


def _save(ckpt, model, optimizer, step: int, healthy: bool = True) -> None:
    assert ckpt.save(step, model, optimizer, extra={"step": step}, healthy=healthy, wait=True)


def _steps_two_and_four(location, keep_last: int):
    """Checkpoints of steps 2 and 4 (a training step between them) at `location`:
    (storage, its open Checkpointer, model, optimizer)."""
    uri, options = location
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, keep_last=keep_last)
    _save(ckpt, model, optimizer, 2)
    train_step(model, optimizer, batch_for(3))
    _save(ckpt, model, optimizer, 4)
    return storage, ckpt, model, optimizer


def test_a_corrupted_shard_is_detected_and_the_previous_one_used(location, caplog) -> None:
    uri, options = location
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, keep_last=5)
    _save(ckpt, model, optimizer, 2)
    at_two = params_of(model)
    train_step(model, optimizer, batch_for(3))
    _save(ckpt, model, optimizer, 4)
    corrupt(storage, "step-000004/__0_0.distcp")

    model2, optimizer2 = _fresh(seed=3)
    with caplog.at_level(logging.WARNING, logger="rlft.checkpoint"):
        resumed = load(storage, "auto", model2, optimizer2)
    assert resumed.step == 2
    assert "step-000004 is damaged (__0_0.distcp: checksum mismatch" in caplog.text
    assert "falling back to the previous one" in caplog.text
    assert all(torch.equal(v, at_two[k]) for k, v in params_of(model2).items())

    # A step asked for by name is that one: damaged, an error naming it and what to do,
    # not the older step 2 the caller did not choose; nothing is loaded.
    model3, optimizer3 = _fresh(seed=3)
    before = params_of(model3)
    with pytest.raises(DamagedCheckpointsError) as raised:
        load(storage, 4, model3, optimizer3)
    message = str(raised.value)
    assert "--resume=4" in message and "step-000004: __0_0.distcp: checksum mismatch" in message
    assert "step-000002" not in message and "resume another step" in message
    assert all(torch.equal(v, before[k]) for k, v in params_of(model3).items())


def test_a_truncated_or_emptied_shard_is_damage_and_the_older_checkpoint_is_used(
    location, tmp_path: Path, capsys
) -> None:
    """A shard object shorter than its manifest says: on S3 the pieces past its end were
    a 416 (InvalidRange), a permanent store error, and resume and export failed (exit 1,
    retried forever by the operator) instead of falling back to the intact step 1."""
    uri, options = location
    flags = _cli_flags(options)
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, keep_last=5, hf_files=hf_files_of(model), block_bytes=4096)
    _save(ckpt, model, optimizer, 1)
    at_one = params_of(model)
    train_step(model, optimizer, batch_for(2))
    _save(ckpt, model, optimizer, 2)
    ckpt.close()
    key = "step-000002/__0_0.distcp"
    shard = storage.get_bytes(key)
    for damaged in (shard[: len(shard) // 2 // 4096 * 4096], b""):
        storage.put_bytes(key, damaged)
        model2, optimizer2 = _fresh(seed=3)
        assert load(storage, "auto", model2, optimizer2, retry_s=5).step == 1
        assert all(torch.equal(v, at_one[k]) for k, v in params_of(model2).items())
    out = tmp_path / "hf"
    assert rlft(["export", "--latest-checkpoint", uri, str(out), *flags]) == 0
    assert "exported step-000001" in capsys.readouterr().out


def test_a_full_local_disk_fails_the_resume_naming_it(s3_env, bucket, tmp_path) -> None:
    """The copy a resume downloads from S3 (file:// is read in place) fills the local
    disk: the load failed with DCP's raw exception; now it names the disk and TMPDIR,
    and the checkpoints stay as they were."""
    location = (f"s3://{bucket}/run", s3_options(s3_env))
    storage, ckpt, *_ = _steps_two_and_four(location, keep_last=5)
    ckpt.close()
    full = r"no space left .* the copy for the resume goes"
    with tmpfs(tmp_path / "small", "256k") as small, pytest.raises(StorageFullError, match=full):
        load(storage, "auto", *_fresh(seed=3), cache_dir=small, retry_s=5)
    assert load(storage, "auto", *_fresh(seed=3), retry_s=5).step == 4


def test_only_damaged_checkpoints_are_an_error_not_a_fresh_start(location) -> None:
    """Committed checkpoints that are all damaged must not read as "no checkpoint" (a
    fresh start would move `latest` back and abandon their steps): every choice raises,
    naming each damaged folder, and the location is left as it was."""
    storage, ckpt, _, _ = _steps_two_and_four(location, keep_last=5)
    ckpt.close()
    corrupt(storage, "step-000002/__0_0.distcp")
    storage.delete_prefix("step-000004/extra.json")
    before = {info.key: info.size for info in storage.list("")}

    for which in ("auto", "latest-healthy"):
        with pytest.raises(DamagedCheckpointsError) as raised:
            load(storage, which, *_fresh(seed=3))
        message = str(raised.value)
        assert f"--resume={which} at {storage.uri}" in message
        assert "step-000002: __0_0.distcp: checksum mismatch" in message
        assert "step-000004: extra.json: missing" in message
        assert not isinstance(raised.value, NoCheckpointError)
    assert {info.key: info.size for info in storage.list("")} == before

    # A manifest that cannot be read is damage too, when it is the only commit.
    storage.delete_prefix("step-000002/")
    storage.put_bytes("step-000004/manifest.json", b"{not json")
    for which in ("auto", 4):  # also when named: damaged, not absent (exit 1, not 2)
        with pytest.raises(DamagedCheckpointsError, match="step-000004: "):
            load(storage, which, *_fresh(seed=3))


def test_checkpoints_of_a_newer_rlft_are_refused_and_never_removed(location, capsys) -> None:
    """After a downgrade: a checkpoint whose manifest has a newer format is not damage
    to skip (the run would go on from an older one and its commits would move `latest`
    below the newer run's steps) nor a leftover for retention to delete."""
    uri, options = location
    # keepLast 2: step 2 stays for the load by name; the newer step 4 would be a leftover
    # below `latest` to delete either way
    storage, ckpt, model, optimizer = _steps_two_and_four(location, keep_last=2)
    manifest = storage.get_bytes("step-000004/manifest.json")
    storage.put_bytes(
        "step-000004/manifest.json", manifest.replace(b'"formatVersion": 1', b'"formatVersion": 7')
    )
    for which in ("auto", "latest-healthy", 4):
        with pytest.raises(NewerFormatError, match=r"step-000004.*upgrade rlft"):
            load(storage, which, *_fresh(seed=3))
    assert load(storage, 2, *_fresh(seed=3)).step == 2  # an older step, named
    # A commit after it (the run named step 2) leaves the newer checkpoint where it is,
    # and resumes go on from this rlft's newest, above it.
    _save(ckpt, model, optimizer, 6)
    ckpt.close()
    assert load(storage, "auto", *_fresh(seed=3)).step == 6
    assert storage.get_bytes("step-000004/manifest.json").count(b'"formatVersion": 7') == 1
    assert {info.key for info in storage.list("step-000004/")} >= {"step-000004/__0_0.distcp"}
    flags = _cli_flags(options)
    capsys.readouterr()
    assert rlft(["checkpoints", "list", uri, *flags]) == 0
    assert "written by a newer rlft" in capsys.readouterr().out
    assert rlft(["checkpoints", "verify", uri, *flags]) == 0  # not damage
    assert "step-000004: NOT CHECKED: " in capsys.readouterr().out


def test_with_a_job_uid_other_jobs_checkpoints_are_never_candidates(location) -> None:
    """`resume: never` on the operator: the job's manifests carry its uid, and its
    resumes pass over another job's checkpoints at the same location, even a better
    candidate (here the newest healthy one), and its retention leaves them."""
    uri, options = location
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    mine = Checkpointer(storage, keep_last=5, job_uid="job-a")
    _save(mine, model, optimizer, 4)
    at_four = params_of(model)
    train_step(model, optimizer, batch_for(5))
    other = Checkpointer(storage, keep_last=5, job_uid="job-b")
    _save(other, model, optimizer, 5)
    other.close()
    _save(mine, model, optimizer, 6, healthy=False)
    mine.close()
    scan = Catalog(storage).scan()
    assert {s: m.job_uid for s, m in scan.manifests.items()} == {4: "job-a", 5: "job-b", 6: "job-a"}
    # job-a's retention left job-b's 5 (off its timeline, but not its to delete), which
    # is a step like any other named without a uid
    assert load(storage, 5, *_fresh(seed=3)).step == 5
    model2, optimizer2 = _fresh(seed=3)
    assert load(storage, "latest-healthy", model2, optimizer2, job_uid="job-a").step == 4
    assert all(torch.equal(v, at_four[k]) for k, v in params_of(model2).items())
    with pytest.raises(NoCheckpointError):
        load(storage, 5, *_fresh(seed=3), job_uid="job-a")  # not one of its own


@pytest.mark.parametrize("refused", [".distcp", ".metadata"])
def test_a_download_the_store_refuses_is_that_error_not_a_damaged_checkpoint(
    s3_env, bucket, store_proxy, refused
) -> None:
    """Refused credentials (or a vanished bucket) would refuse every checkpoint alike:
    the resume reports that, instead of calling each checkpoint damaged. The shards are
    read in ranged pieces, DCP's metadata as a whole file: a refusal of either."""
    storage = open_storage(f"s3://{bucket}/run", s3_options(s3_env))
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage)
    _save(ckpt, model, optimizer, 2)
    ckpt.close()
    behind = _behind(store_proxy, s3_env, bucket)
    store_proxy.deny(refused)  # the manifest and `latest` still read
    with pytest.raises(CredentialsError, match="AccessDenied"):
        load(behind, "auto", *_fresh(seed=3), retry_s=30)
    assert store_proxy.denied >= 1
    store_proxy.release()
    assert load(behind, "auto", *_fresh(seed=3)).step == 2


def _behind(proxy, s3_env, bucket: str):
    """The test's location as a trainer reaches it through `proxy`."""
    return open_storage(f"s3://{bucket}/run", s3_options(s3_env, endpoint_url=proxy.url))


def test_a_resume_that_finds_nothing_leaves_the_optimizer_as_it_was(location) -> None:
    """Reading a checkpoint's layout initialises an optimizer's state (a zero step):
    done before there was a checkpoint to load, a fresh run's first AdamW step took the
    bias correction of a second one, and a run resumed from its own step differed from
    one never interrupted."""
    uri, options = location
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    with pytest.raises(NoCheckpointError):
        load(storage, "auto", model, optimizer)
    assert optimizer.state_dict()["state"] == {}


def test_another_models_checkpoint_is_named_not_a_traceback(location) -> None:
    """A job resumed where another model's checkpoints are (its shapes differ): DCP's
    traceback and exit 1 (retried forever) became an error naming the checkpoint and
    what to do, which the CLI exits 2 for."""
    from checkpoint_fixtures import tiny_config

    from rlft.trainer.checkpoint.errors import ForeignCheckpointError

    uri, options = location
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage)
    _save(ckpt, model, optimizer, 2)
    ckpt.close()
    wider = tiny_model(0, tiny_config().__class__(**{**tiny_config().to_dict(), "hidden_size": 96}))
    with pytest.raises(ForeignCheckpointError) as refused:
        load(storage, "auto", wider, torch.optim.AdamW(wider.parameters(), lr=1e-2))
    message = str(refused.value)
    assert "step-000002 holds another model's checkpoint (Size mismatch" in message, message
    assert "--overwrite" in message


def test_a_reference_added_to_a_run_under_way_is_named_as_that(location) -> None:
    """A suspended job edited to add a KL term, then resumed: its checkpoints have no
    reference model. The refusal said "another model's checkpoint" and advised
    --overwrite, which throws the job's progress away; it now says what was added."""
    import copy

    from rlft.trainer.checkpoint.errors import ForeignCheckpointError

    uri, options = location
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage)
    _save(ckpt, model, optimizer, 2)
    ckpt.close()
    model, optimizer = _fresh()
    with pytest.raises(ForeignCheckpointError) as refused:
        load(storage, "auto", model, optimizer, modules={"reference": (copy.deepcopy(model), None)})
    message = str(refused.value)
    assert "step-000002 was written by a run of this job without the reference model" in message
    assert "spec.algorithm.kl.coef" in message and "--overwrite" not in message, message


def test_nothing_intact_is_a_clear_error(tmp_path: Path, capsys) -> None:
    storage = open_storage(str(tmp_path))
    model, optimizer = _fresh()
    with pytest.raises(NoCheckpointError, match="committed steps: none"):
        load(storage, "auto", model, optimizer)
    ckpt = Checkpointer(storage)
    _save(ckpt, model, optimizer, 5)
    with pytest.raises(NoCheckpointError, match=r"--resume=7 .*\(committed steps: 5\)"):
        load(storage, 7, model, optimizer)
    # Saved without its Hugging Face files: resumable, but not exportable (not "damaged").
    assert rlft(["export", str(tmp_path), str(tmp_path / "hf")]) == 1
    error = capsys.readouterr().err
    assert "no usable checkpoint for export" in error, error
    assert "step-000005: no hf/config.json (saved without hf_files)" in error
    assert "export another step" in error and "delete" not in error
    with pytest.raises(CheckpointError, match=r"extra\['bad'\] is not JSON-serialisable"):
        ckpt.save(6, model, optimizer, extra={"ok": 1, "bad": torch.zeros(1)})


def test_retention_healthy_tags_and_rollback_timeline(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}")
    catalog = Catalog(storage)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, keep_last=2)
    for step in range(1, 7):
        _save(ckpt, model, optimizer, step, healthy=step in (1, 3))
    scan = catalog.scan()
    assert sorted(scan.manifests) == [1, 3, 5, 6] and scan.latest == 6
    # latest-healthy takes the newest healthy one (a rollback)
    resumed = load(storage, "latest-healthy", model, optimizer)
    assert resumed.step == 3
    # committing step 4 on the rolled-back timeline drops the abandoned 5 and 6
    _save(ckpt, model, optimizer, 4, healthy=False)
    scan = catalog.scan()
    assert sorted(scan.manifests) == [1, 3, 4] and scan.latest == 4
    assert load(storage, "auto", model, optimizer).step == 4
    assert not any(info.key.startswith("step-000006") for info in storage.list())


def test_cli_lists_verifies_and_exports(location, tmp_path: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    from rlft.trainer.model.construct import from_pretrained

    uri, options = location
    flags = _cli_flags(options)
    storage = open_storage(uri, options)
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, hf_files=hf_files_of(model))
    _save(ckpt, model, optimizer, 3)
    train_step(model, optimizer, batch_for(4))
    _save(ckpt, model, optimizer, 4, healthy=False)
    storage.put_bytes("step-000009/__0_0.distcp", b"interrupted upload")

    assert rlft(["checkpoints", "list", uri, *flags]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[1].split()[:3] == ["3", "yes", "1"]
    assert listing[2].split()[:3] == ["4", "no", "1"] and listing[2].endswith("latest")
    assert listing[3].split()[0] == "9" and listing[3].endswith("uncommitted")

    assert rlft(["checkpoints", "verify", uri, *flags]) == 0
    assert capsys.readouterr().out.splitlines() == ["step-000003: ok", "step-000004: ok"]
    corrupt(storage, "step-000003/extra.json")
    assert rlft(["checkpoints", "verify", uri, *flags]) == 1
    assert "step-000003: DAMAGED: extra.json: checksum mismatch" in capsys.readouterr().out

    out = tmp_path / "hf"
    assert rlft(["export", uri, str(out), *flags]) == 0  # the location → its latest
    assert "exported step-000004" in capsys.readouterr().out
    exported = from_pretrained(AutoModelForCausalLM, out)
    for name, value in exported.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert rlft(["export", f"{uri}/step-000004", str(out), *flags]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    # --step checks that step alone: another's damaged manifest neither prints nor fails
    # it (it did both), and the damaged manifest named is reported once, as damage.
    storage.put_bytes("step-000004/manifest.json", b"{not json")
    assert rlft(["checkpoints", "verify", uri, "--step", "3", *flags]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("step-000003: DAMAGED: extra.json: checksum mismatch")
    assert rlft(["checkpoints", "verify", uri, "--step", "4", *flags]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("step-000004: DAMAGED: ")
    _save(ckpt, model, optimizer, 5)
    assert rlft(["checkpoints", "verify", uri, "--step", "5", *flags]) == 0
    assert capsys.readouterr().out.splitlines() == ["step-000005: ok"]
    # A step folder named is that step, as export takes it (it checked the folder as a
    # location: "no committed checkpoints", exit 0, for a damaged step).
    assert rlft(["checkpoints", "verify", f"{uri}/step-000003", *flags]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("step-000003: DAMAGED: extra.json: checksum mismatch")
    assert rlft(["checkpoints", "verify", f"{uri}/step-000005/", *flags]) == 0
    assert capsys.readouterr().out.splitlines() == ["step-000005: ok"]


def test_an_export_keeps_the_generation_config_and_is_readable(tmp_path: Path, capsys) -> None:
    """An instruct model's generation config (its stop tokens, sampling defaults) was
    replaced by one derived from config.json; the folder was its owner's alone (0700);
    a missing parent folder failed after the whole download, with a traceback."""
    import json
    import os

    storage = open_storage(f"file://{tmp_path}/ckpts")
    model, optimizer = _fresh()
    model.generation_config.eos_token_id = [1, 2]
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.6
    ckpt = Checkpointer(storage, hf_files=hf_files_of(model))
    _save(ckpt, model, optimizer, 3)
    ckpt.close()
    out = tmp_path / "hf"
    assert rlft(["export", f"file://{tmp_path}/ckpts", str(out)]) == 0
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 2] and generation["temperature"] == 0.6
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    capsys.readouterr()
    # The README's `rlft export … out/hf` in a fresh folder: the parents are made...
    nested = tmp_path / "new" / "out" / "hf"
    assert rlft(["export", f"file://{tmp_path}/ckpts", str(nested)]) == 0
    assert (nested / "config.json").is_file()
    # ...and go again when the export fails (nothing left behind)
    (tmp_path / "empty").mkdir()
    failed = tmp_path / "made" / "for" / "hf"
    assert rlft(["export", f"file://{tmp_path}/empty", str(failed)]) == 1
    assert not (tmp_path / "made").exists()
    (tmp_path / "afile").write_text("mine")
    assert rlft(["export", f"file://{tmp_path}/ckpts", str(tmp_path / "afile" / "hf")]) == 1
    assert f"cannot make {tmp_path / 'afile'}" in capsys.readouterr().err


def test_a_file_uri_rlft_prints_is_taken_back(tmp_path: Path, capsys) -> None:
    """rlft names a local location by its percent-encoded file:// URI (a space is %20),
    and such a URI given back to rlft named a folder with `%20` in its name: `verify`
    found no folder, and `export` of a step found no checkpoint, with advice about
    `--resume`, a flag that export does not have."""
    root = tmp_path / "my run" / "checkpoints"
    storage = open_storage(str(root))
    assert "my%20run" in storage.uri
    assert open_storage(storage.uri).root == root
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, hf_files=hf_files_of(model))
    _save(ckpt, model, optimizer, 1)
    ckpt.close()
    assert rlft(["checkpoints", "verify", storage.uri]) == 0
    assert capsys.readouterr().out.splitlines() == ["step-000001: ok"]
    assert rlft(["export", f"{storage.uri}/step-000001", str(tmp_path / "hf")]) == 0
    assert "exported step-000001" in capsys.readouterr().out
    assert rlft(["export", f"{storage.uri}/step-000009", str(tmp_path / "hf9")]) == 1
    error = capsys.readouterr().err
    assert "no intact checkpoint for export of step-000009" in error, error
    assert "--resume" not in error and "committed steps: 1" in error


def test_every_exported_file_is_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """The folder was made readable for a model server run by another user, but
    transformers writes model.safetensors for its owner alone (0600)."""
    import os

    storage = open_storage(f"file://{tmp_path}/ckpts")
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage, hf_files=hf_files_of(model))
    _save(ckpt, model, optimizer, 3)
    ckpt.close()
    out = tmp_path / "hf"
    before = os.umask(0o022)
    try:
        assert rlft(["export", f"file://{tmp_path}/ckpts", str(out)]) == 0
    finally:
        os.umask(before)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [out, *out.rglob("*")]}
    assert "model.safetensors" in modes and "config.json" in modes
    expected = {p.name: oct(0o755 if p.is_dir() else 0o644) for p in [out, *out.rglob("*")]}
    assert modes == expected


class RacedByALiveRun:
    """A reader's view of a location a live run writes to: after the `nth` call of its
    `method`, `race` runs once (the run commits, and its retention deletes what the
    reader just listed or is fetching)."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, None

    def __getattr__(self, name: str):
        call = getattr(self.inner, name)
        if self.armed is None or self.armed[0] != name:
            return call

        def raced(*args, **kwargs):
            result = call(*args, **kwargs)
            method, nth, race = self.armed
            self.armed = (method, nth - 1, race) if nth > 1 else None
            if nth == 1:
                race()
            return result

        return raced

    def arm(self, method: str, nth: int, race) -> None:
        self.armed = (method, nth, race)


def test_checkpoints_deleted_while_read_are_gone_not_damaged_nor_a_crash(
    location, tmp_path: Path, monkeypatch, capsys
) -> None:
    """`rlft checkpoints list/verify` and `rlft export` on the location of a running job
    (keepLast 1): its retention deleted a checkpoint between their listing and their
    reads, and they ended in a traceback (ObjectMissingError) or called it damaged."""
    from rlft.trainer.checkpoint import commands
    from rlft.trainer.checkpoint.export import export_hf

    uri, options = location
    model, optimizer = _fresh()
    live = Checkpointer(open_storage(uri, options), keep_last=1, hf_files=hf_files_of(model))
    steps = iter(range(1, 100))

    def commit() -> None:
        _save(live, model, optimizer, next(steps), healthy=False)

    commit()
    reader = RacedByALiveRun(open_storage(uri, options))
    catalog = Catalog(reader)
    reader.arm("list", 1, commit)  # 2 commits; 1, just listed, goes
    scan = catalog.scan()
    assert scan.manifests == {} and scan.vanished == {1} and not scan.unreadable
    scan = catalog.scan()
    reader.arm("list", 1, commit)  # 3 commits; 2 goes while checked
    assert catalog.verify(scan.manifests[2]) and catalog.gone(scan.manifests[2])

    monkeypatch.setattr(commands, "open_storage", lambda *_: reader)
    reader.arm("list", 2, commit)  # 4 commits; 3 goes between the scan and the check
    assert rlft(["checkpoints", "verify", uri]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "step-000003: deleted meanwhile (retention), not checked"
    ]
    # An export takes the newest checkpoint there is, however the race falls.
    reader.arm("list", 1, commit)  # 5 commits; 4 goes before its manifest is read
    assert export_hf(uri, tmp_path / "a", storage=reader).step == 5
    reader.arm("get_file", 1, commit)  # 6 commits; 5 goes while fetched
    assert export_hf(uri, tmp_path / "b", storage=reader).step == 6
    live.close()


def test_a_resume_waits_out_a_store_that_refuses_for_a_while(s3_env, bucket, store_proxy) -> None:
    """The object store answers 503 to every read for a few seconds (past botocore's own
    retries): the resume retries, and restores once the store is back. It used to end
    the (re)start with exit 1: each operator restart during an outage spent budget."""
    storage = open_storage(f"s3://{bucket}/run", s3_options(s3_env))
    model, optimizer = _fresh()
    ckpt = Checkpointer(storage)
    _save(ckpt, model, optimizer, 2)
    ckpt.close()
    behind = _behind(store_proxy, s3_env, bucket)
    store_proxy.refuse("/", reads=True)
    threading.Timer(4.0, store_proxy.release).start()
    started = time.monotonic()
    assert load(behind, "auto", *_fresh(seed=3), retry_s=120).step == 2
    assert time.monotonic() - started >= 4.0
    store_proxy.refuse("/", reads=True)  # down past the wait: an error, no hang
    with pytest.raises(StorageError) as error:
        load(behind, "auto", *_fresh(seed=3), retry_s=1)
    assert error.value.transient


def test_a_failed_save_leaves_nothing_it_uploaded(s3_env, bucket, store_proxy) -> None:
    """The store refuses one file of a save for good (a 403 AccessDenied for DCP's
    metadata, as a key scoped away from it would get): its other uploads are removed, not
    left above `latest` where retention never looks (the last save of a run stayed)."""
    storage = open_storage(f"s3://{bucket}/run", s3_options(s3_env))
    store_proxy.deny(".metadata", methods={"PUT", "POST"})
    model, optimizer = _fresh()
    # The refusal is permanent (not retried); a short deadline also ended the clean-up,
    # which runs only within it: on a slow machine (a 2 s save) the uploads stayed.
    ckpt = Checkpointer(_behind(store_proxy, s3_env, bucket), retry_seconds=120)
    assert not ckpt.save(7, model, optimizer, extra={"step": 7}, wait=True)
    ckpt.close()
    assert store_proxy.denied >= 1
    assert storage.list("step-000007/") == []
    assert Catalog(storage).scan().uncommitted == set()


def test_listing_or_verifying_a_folder_that_is_not_there_fails(tmp_path: Path, capsys) -> None:
    """A wrong path is an error, not an empty location: `rlft checkpoints verify` as a CI
    gate on a typo passed."""
    for command in ("list", "verify"):
        assert rlft(["checkpoints", command, str(tmp_path / "typo")]) == 1
        assert f"no folder at {tmp_path / 'typo'}" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert rlft(["checkpoints", "verify", str(tmp_path / "empty")]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out
