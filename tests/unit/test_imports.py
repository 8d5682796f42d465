"""dtf's modules import each other without a cycle, and the driver's side stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dtf

PACKAGE = Path(dtf.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """dtf module -> the dtf modules it imports (at module level or inside functions, which run when
    called), including the packages whose __init__ each import runs first."""
    modules = {}
    for f in PACKAGE.rglob("*.py"):
        name = ".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = f
    graph: dict[str, set[str]] = {}
    for name, f in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        for target in list(targets):  # importing a.b.c runs a/__init__ and a/b/__init__ first
            parts = target.split(".")
            targets.update(".".join(parts[:k]) for k in range(1, len(parts)))
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_of_dtf_imports_itself_through_others() -> None:
    graph = import_graph()
    assert "dtf.train.trainer" in graph and "dtf.launch.local" in graph  # the graph is the real one
    assert cycles(graph) == []


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded into dtf's subpackages (dtf.train, dtf.data, ...) and top-level
    modules (dtf.cli, dtf.rank, ...): one node each, an edge wherever a module of one imports a
    module of another."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    folded: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "dtf":
            continue  # the root package: dtf.run and friends, imported on first use (importlib)
        mine = unit(module)
        folded.setdefault(mine, set()).update(unit(t) for t in targets if t != "dtf" and unit(t) != mine)
    return folded


def test_no_package_of_dtf_imports_itself_through_others() -> None:
    # config is the floor, then dist, data and strategy, train, launch; the ways in (cli, api,
    # preflight, rank) stand on all of them: a package that imports back up makes a cycle here.
    graph = package_graph(import_graph())
    assert "dtf.config" in graph and graph["dtf.config"] <= {"dtf.errors", "dtf.signals"}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_command_line_imports_no_training_stack() -> None:
    # The driver composes, validates and launches; the trainer, strategies and data readers load in the ranks.
    rank_side = ("dtf.train.trainer", "dtf.strategy", "dtf.data.parquet", "dtf.train.loop")
    code = f"import sys, dtf.cli; print(sorted(m for m in sys.modules if m.startswith({rank_side})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
