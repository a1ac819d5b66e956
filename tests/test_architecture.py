"""The floor plan holds: every module in a row of the layer table (docs/architecture.md), imports pointing down it
only, no import cycle among hf_tune's modules, and ``import hf_tune`` stays light."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import REPO
import launch

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
    for target in direct_imports(path, modules):
        found.add(target)
        package = target.rpartition(".")[0]
        while package in modules and not name.startswith(package + "."):
            found.add(package)
            package = package.rpartition(".")[0]
    return found


def direct_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The hf_tune modules a file imports by name, at module level or inside functions (a name imported from a
    module counts as its module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_tune"):
            targets = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.startswith("hf_tune")]
        else:
            continue
        for target in targets:
            while target not in modules:
                target = target.rpartition(".")[0]
            found.add(target)
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
    result = launch.run("python", "-c", code, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


ARCHITECTURE = REPO / "docs" / "architecture.md"


def layer_table(text: str) -> list[list[str]]:
    """The entries of each row of the Layers table in docs/architecture.md, top (highest) row first: module paths
    relative to ``hf_tune/`` (``lifecycle/hub.py``) or folders (``data/``), each in backticks in the second column."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    return [re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[2]) for row in rows]


def layer_of_each_module(table: list[list[str]], modules: dict[str, Path]) -> dict[str, int]:
    """Each module's layer (0 = the top row). A module named in a row belongs there; a folder's other modules to the
    folder's row."""
    layers: dict[str, int] = {}
    for rank, entries in enumerate(table):
        for entry in entries:
            if entry.endswith(".py"):
                layers.setdefault(entry, rank)
    for rank, entries in enumerate(table):
        for folder in (entry for entry in entries if entry.endswith("/")):
            for path in (PACKAGE / folder).rglob("*.py"):
                layers.setdefault(str(path.relative_to(PACKAGE)), rank)
    by_name = {str(path.relative_to(PACKAGE)): name for name, path in modules.items()}
    return {by_name[entry]: rank for entry, rank in layers.items() if entry in by_name}


def layer_violations(layers: dict[str, int], modules: dict[str, Path]) -> list[str]:
    return sorted(f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]})"
                  for name, path in modules.items() for target in direct_imports(path, modules)
                  if layers[target] < layers[name])


def test_the_layer_table_lists_every_module_and_names_only_real_ones():
    modules = module_names()
    table = layer_table(ARCHITECTURE.read_text())
    entries = [entry for row in table for entry in row]
    assert [entry for entry in entries if not (PACKAGE / entry).exists()] == []
    assert sorted(set(modules) - set(layer_of_each_module(table, modules))) == []


def test_imports_point_down_the_layer_table_only():
    modules = module_names()
    layers = layer_of_each_module(layer_table(ARCHITECTURE.read_text()), modules)
    assert layer_violations(layers, modules) == []


def test_the_layer_check_finds_an_import_up_the_table(tmp_path):
    table = layer_table("\n## Layers\n| layer | modules |\n|---|---|\n| top | `run.py` |\n| leaves | `errors.py` |\n")
    assert table == [["run.py"], ["errors.py"]]
    leaf = tmp_path / "errors.py"
    leaf.write_text("from hf_tune.run import main\n")
    modules = {"hf_tune.run": tmp_path / "run.py", "hf_tune.errors": leaf}
    (tmp_path / "run.py").write_text("import hf_tune.errors\n")
    assert layer_violations({"hf_tune.run": 0, "hf_tune.errors": 1}, modules) == [
        "hf_tune.errors (layer 1) imports hf_tune.run (layer 0)"]
