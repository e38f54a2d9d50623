"""`spec.rollout.engine: auto`: vLLM where this machine has it, else transformers,
decided the same way by `rlft train` (which interpreter runs the local servers) and by a
rollout server (whether it can import vLLM)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlft.trainer.config import RolloutSpec
from rlft.trainer.rollout import local
from rlft.trainer.rollout.served import resolve_engine
from rlft.trainer.rollout.session import local_engine, uses_servers


def _without_vllm(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RLFT_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(local, "REPO_ROOT", tmp_path)  # no .venv-vllm there


def test_auto_without_vllm_is_the_in_process_transformers_engine(monkeypatch, tmp_path) -> None:
    _without_vllm(monkeypatch, tmp_path)
    rollout = RolloutSpec(engine="auto")
    assert local_engine(rollout) == "transformers"
    assert not uses_servers(rollout)


def test_auto_with_vllm_runs_a_vllm_server(monkeypatch, tmp_path) -> None:
    _without_vllm(monkeypatch, tmp_path)
    monkeypatch.setenv("RLFT_VLLM_PYTHON", sys.executable)
    rollout = RolloutSpec(engine="auto")
    assert local_engine(rollout) == "vllm"
    assert uses_servers(rollout)
    # Asking for in-process generation keeps the trainer's own model, vLLM or not.
    in_process = RolloutSpec(engine="auto", local="in-process")
    assert local_engine(in_process) == "transformers"
    assert not uses_servers(in_process)


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
