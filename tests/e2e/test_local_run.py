"""Whole local jobs through the real CLI: outputs, learning signal, errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from tiny_jobs import TINY_MODEL
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlft.trainer.cli.main import main
from rlft.trainer.model.construct import from_pretrained

REPO_ROOT = Path(__file__).resolve().parents[2]

METRIC_KEYS = {
    "step",
    "policy_version",
    "reward_mean",
    "loss",
    "grad_norm",
    "kl",
    "entropy",
    "response_len_mean",
    "step_time_s",
}
SUMMARY_KEYS = {"eval_accuracy_sft", "eval_accuracy_final", "eval_problems", "steps", "wall_time_s"}


def write_job(path: Path, spec: dict, name: str = "tiny") -> Path:
    document = {
        "apiVersion": "rlft.dev/v1alpha1",
        "kind": "RLFineTune",
        "metadata": {"name": name},
        "spec": spec,
    }
    path.write_text(yaml.safe_dump(document))
    return path


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def arithmetic_spec(rl_steps: int = 3, kl: float = 0.0) -> dict:
    return {
        "model": TINY_MODEL,
        "data": {"source": "arithmetic", "arithmetic": {"digits": 2, "evalSize": 40}},
        "algorithm": {
            "sft": {"steps": 5, "batchSize": 16, "warmupSteps": 1},
            "groupSize": 4,
            "kl": {"coef": kl},
        },
        "trainer": {"steps": rl_steps, "promptsPerStep": 4, "microBatchSize": 5},
        "rollout": {"sampling": {"maxNewTokens": 4}},
    }


def test_train_writes_metrics_summary_and_a_loadable_model(tmp_path: Path) -> None:
    job = write_job(tmp_path / "job.yaml", arithmetic_spec(rl_steps=3, kl=0.05))
    out = tmp_path / "out"
    assert main(["train", str(job), "--out", str(out)]) == 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row.keys() >= METRIC_KEYS
        assert row["kl"] >= 0 and row["entropy"] > 0 and row["response_len_mean"] >= 1

    summary = json.loads((out / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    assert summary["steps"] == 3 and summary["eval_problems"] == 40
    assert 0.0 <= summary["eval_accuracy_final"] <= 1.0

    model = from_pretrained(AutoModelForCausalLM, out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    ids = tokenizer("12+34=", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] > ids.shape[1]
    assert yaml.safe_load((out / "job.yaml").read_text())["metadata"]["name"] == "tiny"


def test_a_worker_restarted_by_its_rendezvous_starts_over_its_own_files(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """torchrun restarts a gang's workers when a node joins, without counting a restart:
    before the first checkpoint, rank 0 found the files its first start wrote and failed
    the job for good (exit 2, "already holds a run"). A worker of another rendezvous
    still refuses them."""
    job = write_job(tmp_path / "job.yaml", arithmetic_spec(rl_steps=2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "job.yaml").write_text(job.read_text())  # what the first start wrote
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / ".rlft-run-id").write_text("job-uid-0\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-launch")
    assert main(["train", str(job), "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-uid-0")
    assert main(["train", str(job), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "loss" in rows[0]
    assert (out / ".rlft-run-id").read_text() == "job-uid-0\n"


def test_max_steps_caps_the_run_and_existing_output_is_kept(tmp_path: Path, capsys) -> None:
    job = write_job(tmp_path / "job.yaml", arithmetic_spec(rl_steps=50))
    out = tmp_path / "out"
    assert main(["train", str(job), "--out", str(out), "--max-steps", "2"]) == 0
    first = (out / "metrics.jsonl").read_text()
    assert len(first.splitlines()) == 2

    # A second run into the same folder that may not resume refuses instead of
    # clobbering the first one...
    args = ["train", str(job), "--out", str(out), "--max-steps", "3"]
    assert main([*args, "--resume", "never"]) == 2
    error = capsys.readouterr().err  # it has checkpoints: said was "no checkpoint to resume"
    assert "already holds a run" in error and "does not resume (resume: never)" in error
    assert (out / "metrics.jsonl").read_text() == first
    # ...by default it continues from the last checkpoint...
    assert main(args) == 0
    assert "resumed from the checkpoint of step 2" in capsys.readouterr().out
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert "\n".join(lines[:2]) + "\n" == first
    # ...also when nothing is left to train (a run killed after its last checkpoint):
    # that checkpoint is not saved again (its manifest withdrawn while the files are
    # rewritten, `latest` naming it all the while).
    manifest = out / "checkpoints" / "step-000003" / "manifest.json"
    before = (manifest.read_bytes(), manifest.stat().st_mtime_ns)
    assert main(args) == 0
    assert "resumed from the checkpoint of step 3" in capsys.readouterr().out
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before
    assert json.loads((out / "summary.json").read_text())["last_checkpoint_step"] == 3
    # ...and a cap below the step resumed trains nothing and says the step it is at
    # (summary.json said the cap: 2 steps of a model at step 3)
    assert main(["train", str(job), "--out", str(out), "--max-steps", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    # ...and --overwrite replaces it.
    assert main(["train", str(job), "--out", str(out), "--max-steps", "1", "--overwrite"]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_grpo_learns_a_user_reward(tmp_path: Path, monkeypatch) -> None:
    """With a reward only GRPO can see (completions starting with '7'), the policy moves
    towards it: the learning signal flows end to end (sampling, scoring, advantages,
    loss, optimizer)."""
    (tmp_path / "sevens.py").write_text(
        "def starts_with_seven(completion, answer):\n"
        "    return 1.0 if completion.startswith('7') else 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "7"}) + "\n" for i in range(20))
    )
    spec = {
        "model": TINY_MODEL,
        "data": {"source": "jsonl", "jsonl": {"train": str(prompts)}},
        "reward": {"functions": [{"name": "sevens:starts_with_seven"}]},
        "algorithm": {"sft": {"steps": 0}, "groupSize": 8},
        "trainer": {"steps": 40, "promptsPerStep": 8, "learningRate": 0.01, "seed": 3},
        "rollout": {"sampling": {"maxNewTokens": 2}},
        # Learning to always answer "7" *is* an entropy collapse; here it is the goal.
        "stability": {"onCollapse": "alert"},
    }
    out = tmp_path / "out"
    assert main(["train", str(write_job(tmp_path / "job.yaml", spec)), "--out", str(out)]) == 0
    rewards = [json.loads(line)["reward_mean"] for line in (out / "metrics.jsonl").open()]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.3, rewards


def test_dpo_on_a_jsonl_source_without_an_eval_file_trains(tmp_path: Path) -> None:
    """spec.data.jsonl.eval is optional: a DPO job without it stopped before its first
    step with `rlft: max() arg is an empty sequence` (the held-out pair accuracy of no
    pairs). Its held-out figures are NaN, as a GRPO job's accuracy is."""
    prompts = tmp_path / "pairs.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20))
    )
    spec = {
        "model": TINY_MODEL,
        "data": {"source": "jsonl", "jsonl": {"train": str(prompts)}},
        "algorithm": {"name": "dpo", "dpo": {"pairsPerStep": 4}},
        "trainer": {"steps": 2, "microBatchSize": 8},
        "rollout": {"sampling": {"maxNewTokens": 4}},
    }
    out = tmp_path / "out"
    assert main(["train", str(write_job(tmp_path / "job.yaml", spec)), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
    assert summary["eval_preference_accuracy_final"] != summary["eval_preference_accuracy_final"]


def test_a_run_cut_by_max_steps_and_resumed_evaluates_the_steps_the_whole_run_does(
    tmp_path: Path,
) -> None:
    """eval.everySteps: 1 evaluates every step but the last, whose evaluation is the final
    one. A run cut by --max-steps 2 took step 2 for its last and left its record without
    eval_accuracy, so the resumed run's history differed from the uninterrupted one."""
    spec = arithmetic_spec(rl_steps=3) | {"eval": {"everySteps": 1, "maxProblems": 10}}
    job = write_job(tmp_path / "job.yaml", spec)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert main(["train", str(job), "--out", str(whole)]) == 0
    assert main(["train", str(job), "--out", str(cut), "--max-steps", "2"]) == 0
    assert main(["train", str(job), "--out", str(cut)]) == 0

    def evaluations(out: Path) -> dict[int, float | None]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r.get("eval_accuracy") for r in rows}

    assert evaluations(cut) == evaluations(whole)
    assert evaluations(whole)[2] is not None


def test_bad_job_file_exits_2_naming_the_field(tmp_path: Path, capsys) -> None:
    spec = arithmetic_spec()
    spec["trainer"]["microBatchSize"] = 0
    job = write_job(tmp_path / "job.yaml", spec)
    assert main(["train", str(job), "--out", str(tmp_path / "out")]) == 2
    assert "spec.trainer.microBatchSize: must be ≥ 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_user_reward_module_is_a_clear_error(tmp_path: Path, capsys) -> None:
    spec = arithmetic_spec()
    spec["reward"] = {"functions": [{"name": "no_such_module_xyz:score"}]}
    job = write_job(tmp_path / "job.yaml", spec)
    assert main(["train", str(job), "--out", str(tmp_path / "out")]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_rlft_console_script_runs_validate() -> None:
    rlft = Path(sys.executable).parent / "rlft"
    result = subprocess.run(
        [str(rlft), "validate", str(REPO_ROOT / "examples" / "tiny-grpo.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stderr
    assert "valid RLFineTune 'tiny-grpo'" in result.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_warm_start_stops_once_the_probe_reaches_its_target(
    tmp_path: Path, ranks: int, monkeypatch
) -> None:
    """On two ranks rank 0's probe decides for both (ranks stopping at different steps
    would deadlock in the next step's collectives). A launch leaves nothing in the
    temporary folder (torchrun's own logs went to a torchelastic_* folder per launch)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{i}?", "answer": "7"}) + "\n" for i in range(30))
    )
    spec = {
        "model": TINY_MODEL,
        "data": {"source": "jsonl", "jsonl": {"train": str(prompts), "eval": str(prompts)}},
        "algorithm": {
            "sft": {
                "steps": 300,
                "batchSize": 16,
                "learningRate": 0.01,
                "warmupSteps": 1,
                "stopAtAccuracy": 0.9,
                "probeEverySteps": 5,
                "probeProblems": 32,
            },
            "groupSize": 2,
        },
        "trainer": {"steps": 1, "promptsPerStep": 2},
        "rollout": {"sampling": {"maxNewTokens": 2}},
    }
    out = tmp_path / "out"
    job = str(write_job(tmp_path / "job.yaml", spec))
    assert main(["train", job, "--out", str(out), "--nproc", str(ranks)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == ranks
    assert summary["sft_steps"] < 300 and summary["sft_steps"] % 5 == 0
    assert summary["eval_accuracy_sft"] >= 0.9
    assert not list(temporary.glob("torchelastic_*")) + list(temporary.glob("rlft-*"))


def checkpoint_files(location: Path) -> dict[str, bytes]:
    """Every file of the location but the trainers' local staging folders."""
    return {
        str(p.relative_to(location)): p.read_bytes()
        for p in sorted(location.rglob("*"))
        if p.is_file() and not p.relative_to(location).parts[0].startswith(".rlft-tmp")
    }


def test_a_never_job_restarted_resumes_its_own_checkpoints_not_another_runs(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """On the operator (RLFT_JOB_UID set), `resume: never` means "not the checkpoints of
    another run": a restart given --resume never (the operator had not seen the job's
    checkpoint yet: an emergency one, say) resumes the job's own, and another job with
    the same spec and location starts afresh."""
    spec = arithmetic_spec(rl_steps=4)
    spec["checkpoint"] = {"uri": f"file://{tmp_path}/ckpts", "intervalSteps": 2, "resume": "never"}
    job = str(write_job(tmp_path / "job.yaml", spec))
    monkeypatch.setenv("RLFT_JOB_UID", "job-a")
    assert main(["train", job, "--out", str(tmp_path / "first"), "--max-steps", "2"]) == 0
    capsys.readouterr()
    # A new pod (its own output folder), started with the job's own choice, never.
    again = tmp_path / "again"
    assert main(["train", job, "--out", str(again), "--resume", "never"]) == 0
    output = capsys.readouterr().out
    assert "this job's own checkpoints are here" in output
    assert "resumed from the checkpoint of step 2" in output
    assert [json.loads(line)["step"] for line in (again / "metrics.jsonl").open()] == [1, 2, 3, 4]
    # Another job (another uid) at the same location: a fresh start would overwrite job
    # a's checkpoints (its commits moved `latest`, retention deleted the steps above it,
    # later steps replace the same folders): refused, job a's left as they were.
    before = checkpoint_files(tmp_path / "ckpts")
    monkeypatch.setenv("RLFT_JOB_UID", "job-b")
    other = tmp_path / "other"
    assert main(["train", job, "--out", str(other), "--max-steps", "1"]) == 2
    captured = capsys.readouterr()
    assert "holds the committed checkpoints of another job (uid job-a)" in captured.err
    assert "give it its own spec.checkpoint.uri" in captured.err
    assert checkpoint_files(tmp_path / "ckpts") == before


def test_a_local_run_never_replaces_another_runs_checkpoints_or_outputs_unasked(
    tmp_path: Path, capsys
) -> None:
    """Locally (no job uid to tell runs apart) `--resume never` at a location holding
    committed checkpoints rewrote them and deleted the newer ones; `--resume
    latest-healthy` deleted the output folder's run, its checkpoints included. Both are
    refused (exit 2) and leave everything as it was; --overwrite still abandons them."""
    spec = arithmetic_spec(rl_steps=4)
    spec["checkpoint"] = {"uri": f"file://{tmp_path}/ckpts", "intervalSteps": 2}
    job = str(write_job(tmp_path / "job.yaml", spec))
    first = tmp_path / "first"
    assert main(["train", job, "--out", str(first), "--max-steps", "2"]) == 0
    capsys.readouterr()
    before = checkpoint_files(tmp_path / "ckpts")
    fresh = ["train", job, "--out", str(tmp_path / "second"), "--max-steps", "1"]
    assert main([*fresh, "--resume", "never"]) == 2
    error = capsys.readouterr().err
    assert f"file://{tmp_path}/ckpts holds committed checkpoints (steps 2)" in error
    assert "--overwrite" in error
    assert checkpoint_files(tmp_path / "ckpts") == before
    # the output folder's own run (local checkpoints), asked for latest-healthy of an
    # empty location: refused, the folder kept
    local = arithmetic_spec(rl_steps=4)
    local["checkpoint"] = {"uri": f"file://{tmp_path}/empty", "intervalSteps": 2}
    other = str(write_job(tmp_path / "other.yaml", local))
    kept = sorted(p.name for p in first.iterdir())
    assert main(["train", other, "--out", str(first), "--resume", "latest-healthy"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert sorted(p.name for p in first.iterdir()) == kept
    assert main([*fresh, "--overwrite"]) == 0  # said on purpose: abandoned


def test_a_run_stopped_in_its_warm_start_runs_again_with_the_same_command(
    tmp_path: Path,
) -> None:
    """SIGTERM in the warm start (or a refused --resume) leaves job.yaml and an empty
    checkpoints/: the same command again refused them as "a run" (exit 2)."""
    job = write_job(tmp_path / "job.yaml", arithmetic_spec(rl_steps=1))
    out = tmp_path / "out"
    (out / "checkpoints" / ".rlft-tmp-staging" / "rank-0").mkdir(parents=True)  # a stage
    (out / "job.yaml").write_text(job.read_text())
    assert main(["train", str(job), "--out", str(out)]) == 0
    assert (out / "summary.json").is_file()


def test_ranks_started_with_nproc_exit_with_their_own_code(tmp_path: Path, monkeypatch, capfd):
    """torchrun's agent exits 1 whatever its workers returned; `rlft train --nproc 2` exits
    as its ranks do: 2 for a job that cannot run (a retry would loop on it as on 1)."""
    monkeypatch.delenv("RLFT_TERMINATION_LOG", raising=False)
    spec = arithmetic_spec()
    missing = str(tmp_path / "missing.jsonl")
    spec["data"] = {"source": "jsonl", "jsonl": {"train": missing}}
    job = str(write_job(tmp_path / "job.yaml", spec))
    assert main(["train", job, "--out", str(tmp_path / "out"), "--nproc", "2"]) == 2
    assert "missing.jsonl" in capfd.readouterr().err


def test_settings_the_machine_refuses_are_named_without_a_traceback(tmp_path: Path, capsys):
    """A telemetry port in use (retryable: exit 1) and a staging folder that cannot be made
    (the job's error: exit 2) name their field; they were raw tracebacks with exit 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = arithmetic_spec() | {"telemetry": {"port": taken.getsockname()[1]}}
        job = str(write_job(tmp_path / "busy.yaml", spec))
        assert main(["train", job, "--out", str(tmp_path / "busy")]) == 1
    err = capsys.readouterr().err
    assert "rlft: spec.telemetry: cannot serve /metrics and /status" in err, err
    assert "Traceback" not in err
    spec = arithmetic_spec() | {"checkpoint": {"stagingDir": "/proc/rlft-cannot-be-made"}}
    job = str(write_job(tmp_path / "staging.yaml", spec))
    assert main(["train", job, "--out", str(tmp_path / "staging")]) == 2
    err = capsys.readouterr().err
    assert "rlft: spec.checkpoint.stagingDir: cannot make /proc/rlft-cannot-be-made" in err, err
    assert "Traceback" not in err
