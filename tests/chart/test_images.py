"""The container images. They cannot be built here (no Docker engine); what can be checked is:
multi-stage, pinned bases, a non-root numeric user matching the pods' and the chart's
runAsUser, entrypoints that are real console scripts or modules, the files they copy exist
and are in the build context, the operator image runs without the trainer's dependencies,
and the trainer image installs every program the operator's pods run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from chart_render import ROOT
from example_jobs import parsed_examples

from rlft.operator import manifests as M
from rlft.operator.chart_values import ChartValues

DOCKERFILES = {
    "operator": ROOT / "operator" / "Dockerfile",
    "trainer": ROOT / "trainer" / "Dockerfile",
}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args(path: Path) -> dict[str, str]:
    return dict(
        rest.split("=", 1) for word, rest in _instructions(path) if word == "ARG" and "=" in rest
    )


def _stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for word, rest in _instructions(path):
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, rest))
    return stages


def _exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list), f"use the exec form: {rest}"
    return value


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_with_pinned_bases(name):
    path = DOCKERFILES[name]
    args = _args(path)
    stages = _stages(path)
    assert len(stages) >= 2, "a build stage and a slim runtime stage"
    for stage in stages:
        base = stage[0][1].split()[0]
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        repository, _, tag = base.partition("@")[0].rpartition(":")
        assert repository and tag and tag != "latest", f"{name}: {base} is not pinned"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{name}: pin {base} to a full version"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runtime_stage_runs_as_the_non_root_user_the_pods_expect(name):
    runtime = _stages(DOCKERFILES[name])[-1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users, f"{name}: the runtime stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert (
        uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0
    )  # numeric: runAsNonRoot can check it
    expected = (
        M.Settings().run_as_user
        if name == "trainer"
        else ChartValues().security_context.run_as_user
    )
    assert int(uid) == expected
    assert not any(w in ("RUN", "COPY") for w, _ in runtime[runtime.index(("USER", users[-1])) :])


def test_entrypoints_are_real(tmp_path):
    operator = dict(_stages(DOCKERFILES["operator"])[-1])
    assert _exec_form(operator["ENTRYPOINT"]) == ["python", "-m", "rlft.operator"]
    result = subprocess.run(
        [sys.executable, "-m", "rlft.operator", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0 and "--peering" in result.stdout, result.stderr
    trainer = dict(_stages(DOCKERFILES["trainer"])[-1])
    (script,) = _exec_form(trainer["ENTRYPOINT"])
    assert script in PYPROJECT["project"]["scripts"]
    command = [str(Path(sys.executable).parent / script), *_exec_form(trainer["CMD"])]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0 and "train" in result.stdout, result.stderr


def _ignored(name: str) -> bool:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return any(Path(name).match(p) or name == p or name.startswith(p + "/") for p in patterns)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copied_files_exist_and_are_in_the_build_context(name):
    for word, rest in _instructions(DOCKERFILES[name]):
        if word == "COPY" and "--from" not in rest:
            *sources, _ = [part for part in shlex.split(rest) if not part.startswith("--")]
            for source in sources:
                assert (ROOT / source).exists(), f"{name}: COPY {source}: no such path"
                assert not _ignored(source), f"{name}: COPY {source} but .dockerignore drops it"
    for heavy in (".venv", ".git", "runs"):
        assert _ignored(heavy), f".dockerignore must exclude {heavy}"


def test_the_operator_image_needs_none_of_the_trainers_dependencies():
    """It installs rlft[operator] only; the operator must start without torch & co."""
    (install,) = [
        rest
        for word, rest in _instructions(DOCKERFILES["operator"])
        if word == "RUN" and "pip install" in rest
    ]
    assert '".[operator]"' in install and "trainer" not in install
    extras = PYPROJECT["project"]["optional-dependencies"]
    keep = {
        re.split(r"[<>=\[ ]", d)[0]
        for d in extras["operator"] + PYPROJECT["project"]["dependencies"]
    }
    blocked = sorted({re.split(r"[<>=\[ ]", d)[0].split("-")[0] for d in extras["trainer"]} - keep)
    assert "torch" in blocked and "transformers" in blocked
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not in the operator image")
sys.meta_path.insert(0, Block())
import rlft.operator.handlers, rlft.operator.chart_values, rlft.operator.permissions
from rlft.operator.options import build_parser
build_parser().parse_args(["--all-namespaces"])
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_trainer_image_installs_every_program_the_pods_run():
    programs = set()
    for job, body in parsed_examples(multi_node_rollout=True):
        for pod in M.desired(job, body, M.Settings(), "auto").pods.values():
            command = pod["spec"]["containers"][0]["command"]
            assert command[:3] == ["rlft", "scrubbed", "--"]  # every pod's first process
            programs.add(command[0])
            command = command[3:]
            programs.add(command[0])
            if command[:2] == ["sh", "-c"]:  # a Ray head: `ray start … && exec rlft …`
                for part in command[2].split("&&"):
                    words = part.split()
                    programs.add(words[1] if words[0] == "exec" else words[0])
    assert programs == {"torchrun", "rlft", "sh", "ray"}
    installs = " ".join(
        rest for word, rest in _instructions(DOCKERFILES["trainer"]) if word == "RUN"
    )
    provided_by = {
        "torchrun": "vllm==",  # vLLM brings its CUDA torch, which brings torchrun
        "rlft": '".[trainer]"',
        "ray": "ray[default]==",
    }
    for program in programs - {"sh"}:
        assert provided_by[program] in installs, f"{program}: not installed in the trainer image"
    # and the build checks they run
    assert all(f"{p} --help" in installs for p in ("rlft", "torchrun", "ray"))
    exposed = {
        int(p)
        for w, rest in _stages(DOCKERFILES["trainer"])[-1]
        if w == "EXPOSE"
        for p in rest.split()
    }
    settings = M.Settings()
    assert exposed == {settings.rollout_port, settings.status_port, settings.rdzv_port}


def test_the_rlft_commands_of_the_pods_parse_with_the_real_cli():
    """`rlft scrubbed -- …`, `rlft train …` (after torchrun's `--no-python`) and `rlft
    rollout …` (also behind a Ray head's `exec`), exactly as the operator writes them, are
    accepted by `rlft`'s parser. In a subprocess: building that parser imports the rollout
    engines (torch)."""
    argvs = []
    for job, body in parsed_examples(multi_node_rollout=True):
        for pod in M.desired(job, body, M.Settings(), "auto").pods.values():
            command = pod["spec"]["containers"][0]["command"]
            argvs.append(command[1:4])  # `rlft scrubbed -- PROGRAM`, every pod's first
            command = command[3:]
            if command[0] == "torchrun":
                argvs.append(command[command.index("--no-python") + 2 :])
            elif command[0] == "rlft":
                argvs.append(command[1:])
            elif command[:2] == ["sh", "-c"]:
                argvs.append(shlex.split(command[2].split("exec rlft", 1)[1]))
    assert {argv[0] for argv in argvs} == {"scrubbed", "train", "rollout"}
    code = (
        "import json, sys\n"
        "from rlft.trainer.cli.main import build_parser\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    build_parser().parse_args(argv)\n"
        "print(len(json.loads(sys.argv[1])))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(len(argvs))
