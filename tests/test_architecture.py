"""The floor plan holds: no import cycle among hf_tune's modules, and ``import hf_tune`` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "hf_tune"


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """hf_tune modules imported anywhere in the file, at module level or inside functions, and the packages whose
    ``__init__`` such an import runs (importing ``a.b.c`` runs ``a.b``'s first; the importer's own packages are
    already running)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_tune"):
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.startswith("hf_tune")]
        else:
            continue
        for target in targets:
            while target not in modules:  # a name imported from a module, not a module: its module
                target = target.rpartition(".")[0]
            found.add(target)
            package = target.rpartition(".")[0]
            while package in modules and not name.startswith(package + "."):
                found.add(package)
                package = package.rpartition(".")[0]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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


def test_no_import_cycle_among_hf_tune_modules():
    modules = module_names()
    graph = {name: imports_of(name, path, modules) - {name} for name, path in modules.items()}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_importing_hf_tune_loads_no_heavy_library():
    code = ("import sys, hf_tune; heavy = ('torch', 'transformers', 'optuna', 'deepspeed', 'wandb', 'datasets'); "
            "print(sorted(name for name in heavy if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]
