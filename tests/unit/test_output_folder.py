"""The output folder of `rlft train`: what counts as a run to protect, and a folder that
cannot be made is a clear error (exit 2 through OutputExistsError), not a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlft.trainer.run.job import OutputExistsError, existing_run_files, prepare_output


def test_an_output_path_that_is_a_file_is_named_with_what_to_do(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out in (afile, afile / "sub"):
        with pytest.raises(OutputExistsError, match=r"--out .*afile.*choose a folder"):
            prepare_output(out, overwrite=False)
    assert afile.read_text() == "mine"


def test_only_results_count_as_a_run(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / ".rlft-tmp-staging").mkdir(parents=True)
    (tmp_path / "job.yaml").write_text("x")
    # Opened as the first step began: a run stopped (or killed) before it ended (CI of
    # c2d524c: the rerun was refused, "already holds a run (metrics.jsonl, job.yaml)").
    (tmp_path / "metrics.jsonl").touch()
    assert existing_run_files(tmp_path) == []
    (tmp_path / "checkpoints" / "step-000002").mkdir()
    assert existing_run_files(tmp_path) == ["checkpoints", "job.yaml"]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert existing_run_files(tmp_path) == ["metrics.jsonl", "checkpoints", "job.yaml"]


def test_verifying_a_run_folder_instead_of_its_checkpoints_fails(tmp_path: Path, capsys) -> None:
    """`rlft checkpoints verify RUN` (not RUN/checkpoints) found "no committed
    checkpoints" and exited 0: a CI gate on it checked nothing."""
    from rlft.trainer.cli.main import main

    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    assert main(["checkpoints", "verify", str(tmp_path)]) == 1
    assert f"verify {tmp_path}/checkpoints" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["checkpoints", "verify", str(empty)]) == 0  # an empty location is no damage
