"""`spec.rollout.engine: auto`: locally, vLLM where it is faster (installed, and a GPU
to generate on), else the in-process transformers engine, with the reason in the run's
first lines; a rollout server resolves it by whether it can import vLLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlft.trainer.config import RolloutSpec
from rlft.trainer.rollout import local, session
from rlft.trainer.rollout.served import resolve_engine
from rlft.trainer.rollout.session import choose_engine, local_engine, uses_servers


def _without_vllm(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RLFT_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(local, "REPO_ROOT", tmp_path)  # no .venv-vllm there


def test_auto_without_vllm_is_the_in_process_transformers_engine(monkeypatch, tmp_path) -> None:
    _without_vllm(monkeypatch, tmp_path)
    rollout = RolloutSpec(engine="auto")
    assert local_engine(rollout) == "transformers"
    assert not uses_servers(rollout)


def test_auto_with_vllm_and_a_gpu_runs_a_vllm_server(monkeypatch, tmp_path) -> None:
    _without_vllm(monkeypatch, tmp_path)
    monkeypatch.setenv("RLFT_VLLM_PYTHON", sys.executable)
    monkeypatch.setattr(session.torch.cuda, "is_available", lambda: True)
    rollout = RolloutSpec(engine="auto")
    assert local_engine(rollout) == "vllm"
    assert uses_servers(rollout)
    assert "GPU" in choose_engine(rollout).reason
    # Asking for in-process generation keeps the trainer's own model, vLLM or not.
    in_process = RolloutSpec(engine="auto", local="in-process")
    assert local_engine(in_process) == "transformers"
    assert not uses_servers(in_process)


def test_auto_with_vllm_on_the_cpu_stays_in_process(monkeypatch, tmp_path) -> None:
    """`make run` after `make test` (which builds .venv-vllm): the example job is no
    slower than without it."""
    _without_vllm(monkeypatch, tmp_path)
    monkeypatch.setenv("RLFT_VLLM_PYTHON", sys.executable)
    monkeypatch.setattr(session.torch.cuda, "is_available", lambda: False)
    rollout = RolloutSpec(engine="auto")
    choice = choose_engine(rollout)
    assert choice.engine == "transformers" and "CPU" in choice.reason
    assert not uses_servers(rollout)
    # A job that needs servers anyway (stale samples) gets transformers servers.
    stale = RolloutSpec(engine="auto", max_staleness=1)
    assert uses_servers(stale) and local_engine(stale) == "transformers"


def test_explicit_engines_are_kept(monkeypatch, tmp_path) -> None:
    _without_vllm(monkeypatch, tmp_path)
    assert local_engine(RolloutSpec(engine="vllm")) == "vllm"
    assert local_engine(RolloutSpec(engine="transformers")) == "transformers"
    with pytest.raises(ValueError, match="in-process"):
        RolloutSpec(engine="vllm", local="in-process")


def test_a_server_resolves_auto_by_what_it_can_import(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    assert resolve_engine("auto") == "transformers"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert resolve_engine("auto") == "vllm"
    assert resolve_engine("transformers") == "transformers"


def test_the_trainer_waits_for_operator_rollout_pods_as_long_as_they_may_take() -> None:
    """Placed within the scheduling timeout, serving within the startup probe's: the
    trainer gave up after requestTimeoutSeconds (600 s), and each attempt was a counted
    restart that loaded the model again."""
    from tiny_jobs import TINY_MODEL, manifest

    from rlft.trainer.config import parse_job

    def job(rollout: dict, scheduling: dict):
        spec = {"model": TINY_MODEL, "rollout": rollout, "scheduling": scheduling}
        return parse_job(manifest(spec))

    slow = job({"startupTimeoutSeconds": 2700}, {"schedulingTimeoutSeconds": 600})
    assert session.pods_start_within(slow) == 3300
    quick = job({"startupTimeoutSeconds": 10, "requestTimeoutSeconds": 900}, {})
    assert session.pods_start_within(quick) == 900


def test_a_requests_deadline_allows_a_reissue_within_the_trainers_stall_timeout() -> None:
    """Twice the request timeout (equal, a request timed out on a stalled instance was
    never re-issued), but under the stall timeout: rank 0 waiting on a hung request shows
    no progress, and the liveness probe would end the run before the client named why."""
    from tiny_jobs import TINY_MODEL, manifest

    from rlft.trainer.config import parse_job

    def job(request_s: int, stall_s: int):
        spec = {
            "model": TINY_MODEL,
            "rollout": {"requestTimeoutSeconds": request_s},
            "trainer": {"stallTimeoutSeconds": stall_s},
        }
        return parse_job(manifest(spec))

    assert session.request_deadline(job(600, 1800)) == 1200
    assert session.request_deadline(job(1000, 1800)) == 1620  # 0.9 of the stall timeout
    assert session.request_deadline(job(1000, 0)) == 2000  # no stall timeout
    assert session.request_deadline(job(600, 300)) == 600  # one attempt at least
