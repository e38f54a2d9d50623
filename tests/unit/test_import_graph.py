"""The project's import graph, built from the source with `ast` (every import statement,
including the lazy ones inside functions, counts): no cycle between packages, the pure
cores free of edge code, the operator free of torch."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"rlft.trainer": ROOT / "trainer", "rlft.operator": ROOT / "operator"}

CORES = (
    "rlft.trainer.algorithms",
    "rlft.trainer.stability",
    "rlft.operator.reconcile",
    "rlft.operator.decision",
    "rlft.operator.responses",
    "rlft.operator.failures",
    "rlft.operator.manifests",
    "rlft.operator.pod_spec",
    "rlft.operator.observe",
    "rlft.operator.status",
    "rlft.operator.names",
    "rlft.operator.plan",
)
"""The pure cores: the algorithms, the collapse detector, the operator's planner and the
plan `rlft plan` prints from it."""

EDGE = (
    "aiohttp",
    "boto3",
    "botocore",
    "http.server",
    "kopf",
    "kubernetes",
    "requests",
    "socketserver",
    "torch.distributed",
    "transformers",
    "urllib.request",
)
"""Edge code the cores must not reach: HTTP servers and clients, Kubernetes, S3, process
groups, model adapters."""


def module_files() -> dict[str, Path]:
    out = {}
    for prefix, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


MODULES = module_files()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def imports_of(module: str) -> frozenset[str]:
    """Every module name `module` imports (its own `from X import name` counts as X and,
    where X.name is a project module, X.name)."""
    tree = ast.parse(MODULES[module].read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            names.add(target)
            names |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES}
    return frozenset(n for n in names if n and n != "__future__")


def _with_parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ too."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@cache
def closure(module: str) -> frozenset[str]:
    """Every module, project or not, that importing `module` can import."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        for name in imports_of(current):
            for part in _with_parents(name):
                if part in seen:
                    continue
                seen.add(part)
                if part in MODULES:
                    todo.append(part)
    return frozenset(seen)


def package_of(module: str) -> str:
    """trainer subpackages and top-level modules are nodes; the operator is one node."""
    parts = module.split(".")
    if parts[1] == "operator":
        return "rlft.operator"
    return ".".join(parts[:3])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {package_of(m): set() for m in MODULES if m.count(".") >= 2}
    for module in MODULES:
        if module.count(".") < 2:
            continue
        for name in imports_of(module):
            if name in MODULES and name.count(".") >= 2:
                source, target = package_of(module), package_of(name)
                if source != target:
                    graph[source].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _reaches(module: str, forbidden: str) -> bool:
    return any(n == forbidden or n.startswith(forbidden + ".") for n in closure(module))


def _path(module: str, forbidden: str) -> list[str]:
    """One import chain from `module` to `forbidden`, for the failure message."""
    parents: dict[str, str | None] = {module: None}
    todo = [module]
    while todo:
        current = todo.pop(0)
        for name in imports_of(current):
            for part in _with_parents(name):
                if part == forbidden or part.startswith(forbidden + "."):
                    chain, node = [part], current
                    while node is not None:
                        chain.append(node)
                        node = parents[node]
                    return chain[::-1]
                if part in MODULES and part not in parents:
                    parents[part] = current
                    todo.append(part)
    return []


def test_the_graph_sees_the_project():
    assert "rlft.trainer.algorithms.objectives" in MODULES
    assert "rlft.operator.reconcile" in MODULES
    assert _reaches("rlft.trainer.distributed.runtime", "torch.distributed")
    assert not _reaches("rlft.trainer.exit_codes", "torch")


def test_no_cycle_between_packages():
    found = cycles(package_graph())
    assert not found, f"import cycles between packages: {found}"


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("core", CORES)
def test_cores_do_not_import_edge_code(core):
    modules = [m for m in MODULES if m == core or m.startswith(core + ".")]
    assert modules, core
    bad = {m: e for m in modules for e in EDGE if _reaches(m, e)}
    assert not bad, "; ".join(f"{m} reaches {e}: {' → '.join(_path(m, e))}" for m, e in bad.items())


def test_the_operator_does_not_import_torch():
    operator = [m for m in MODULES if m.startswith("rlft.operator")]
    bad = [m for m in operator if _reaches(m, "torch")]
    assert not bad, "; ".join(" → ".join(_path(m, "torch")) for m in bad)
