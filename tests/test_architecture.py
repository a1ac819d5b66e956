"""The floor plan holds: every module in a row of the layer table (docs/architecture.md), imports pointing down it
only, no import cycle among hf_tune's modules, and ``import hf_tune`` stays light."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import launch
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


def test_importing_hf_tune_or_the_verbs_loads_no_heavy_library_and_changes_nothing_in_the_process():
    code = ("import json, logging, os, sys, warnings\n"
            "def state():\n"
            "    loggers = {name: len(logger.filters) for name, logger in logging.root.manager.loggerDict.items()\n"
            "               if isinstance(logger, logging.Logger)}\n"
            "    return {'env': dict(os.environ), 'warnings': [repr(f) for f in warnings.filters],\n"
            "            'root': [logging.root.level, len(logging.root.handlers)], 'loggers': loggers}\n"
            "before = state()\n"
            "import hf_tune\n"
            "imported = state()\n"
            "from hf_tune.runtime.process import settle_process\n"
            "settle_process()\n"
            "heavy = ('torch', 'transformers', 'optuna', 'deepspeed', 'wandb', 'datasets')\n"
            "loaded = sorted(name for name in heavy if name in sys.modules)\n"
            "from hf_tune.commands import cli\n"
            "cli.parser()  # every verb's module, as hf-tune --help reads them\n"
            "print(json.dumps([loaded, before == imported, state()['env'].get('MKL_CBWR'),\n"
            "                  before['warnings'] != state()['warnings'],\n"
            "                  sorted(name for name in heavy if name in sys.modules)]))")
    result = launch.run("python", "-c", code, timeout=120,
                        base_env={k: v for k, v in os.environ.items() if k != "MKL_CBWR"})
    assert result.returncode == 0, result.stderr[-2000:]
    # no heavy library loaded and nothing changed by the import; settle_process (the entry points', train's) makes
    # the settings; hf-tune's parser, every verb's module imported, loads no heavy library either
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [[], True, "AUTO,STRICT", True, []]


ARCHITECTURE = REPO / "docs" / "architecture.md"


def layer_table(text: str) -> list[list[str]]:
    """The entries of each row of the Layers table in docs/architecture.md, top (highest) row first: folders
    (``data/``) or top-level modules (``errors.py``), each in backticks in the second column."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    return [re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[2]) for row in rows]


def unit_of(path: Path) -> str:
    """The table entry a module belongs to: its top-level folder (``data/``), or itself at the top (``run.py``)."""
    parts = path.parts[path.parts.index("hf_tune") + 1:] if "hf_tune" in path.parts else (path.name,)
    return f"{parts[0]}/" if len(parts) > 1 else parts[0]


def layer_of_each_module(table: list[list[str]], modules: dict[str, Path]) -> dict[str, int]:
    """Each module's layer (0 = the top row): its folder's row; a package's ``__main__`` is an entry point (0)."""
    rows = {entry: rank for rank, entries in enumerate(table) for entry in entries}
    layers = {}
    for name, path in modules.items():
        unit = unit_of(path)
        if path.name == "__main__.py":
            layers[name] = 0
        elif unit in rows:
            layers[name] = rows[unit]
    return layers


def layer_violations(layers: dict[str, int], modules: dict[str, Path], units: dict[str, str]) -> list[str]:
    """Imports into a higher row, or between two folders of one row."""
    return sorted(f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]})"
                  for name, path in modules.items() for target in direct_imports(path, modules)
                  if layers[target] < layers[name] or (layers[target] == layers[name] and layers[name] > 0
                                                      and units[target] != units[name]))


def units_of(modules: dict[str, Path]) -> dict[str, str]:
    return {name: unit_of(path) for name, path in modules.items()}


def test_the_layer_table_places_every_folder_and_names_only_folders_and_top_level_modules():
    modules = module_names()
    table = layer_table(ARCHITECTURE.read_text())
    entries = [entry for row in table for entry in row]
    assert [entry for entry in entries if "/" in entry.rstrip("/") or not (PACKAGE / entry).exists()] == []
    assert len(entries) == len(set(entries))
    assert sorted(set(modules) - set(layer_of_each_module(table, modules))) == []


def test_imports_point_down_the_layer_table_only():
    modules = module_names()
    layers = layer_of_each_module(layer_table(ARCHITECTURE.read_text()), modules)
    assert layer_violations(layers, modules, units_of(modules)) == []


def test_the_layer_check_finds_an_import_up_the_table_or_across_a_row(tmp_path):
    table = layer_table("\n## Layers\n| layer | folders |\n|---|---|\n| top | `run.py` |\n"
                        "| middle | `data/`, `model/` |\n| leaves | `errors.py` |\n")
    assert table == [["run.py"], ["data/", "model/"], ["errors.py"]]
    files = {"hf_tune.run": "import hf_tune.errors\n", "hf_tune.errors": "from hf_tune.data.loading import x\n",
             "hf_tune.data.loading": "from hf_tune.model.loss import y\n", "hf_tune.model.loss": "import hf_tune.errors\n"}
    modules = {}
    for name, text in files.items():
        modules[name] = tmp_path.joinpath(*name.split(".")).with_suffix(".py")
        modules[name].parent.mkdir(parents=True, exist_ok=True)
        modules[name].write_text(text)
    layers = layer_of_each_module(table, modules)
    assert layers == {"hf_tune.run": 0, "hf_tune.errors": 2, "hf_tune.data.loading": 1, "hf_tune.model.loss": 1}
    assert layer_violations(layers, modules, units_of(modules)) == [
        "hf_tune.data.loading (layer 1) imports hf_tune.model.loss (layer 1)",  # across a row
        "hf_tune.errors (layer 2) imports hf_tune.data.loading (layer 1)"]  # up the table


LATE_BOUND = re.compile(r"[\"'](hf_tune(?:\.\w+)+):(\w+)[\"']")


def declared_edges(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """The late-bound strings as edges of the dependency graph: (the module whose table names it, the module named)."""
    return {(name, target) for name, path in modules.items() for target, _ in LATE_BOUND.findall(path.read_text())}


def test_late_bound_strings_are_declared_edges_from_the_tables_to_library_code_below_the_command_line():
    """A late-bound string is the one edge allowed to point up the table, and only from a table (``catalog/``) to
    library code: never to the command line or an entry point, whose modules a library call must not need."""
    modules = module_names()
    table = layer_table(ARCHITECTURE.read_text())
    layers = layer_of_each_module(table, modules)
    command_line = next(rank for rank, entries in enumerate(table) if "commands/" in entries)
    edges = declared_edges(modules)
    assert {unit_of(modules[source]) for source, _ in edges} == {"catalog/"}
    assert sorted(f"{source} -> {target}" for source, target in edges if layers[target] <= command_line) == []
    # the tables that name hf_tune's own code (methods name TRL's classes; shipped rewards live in their table)
    assert {source.rpartition(".")[2] for source, _ in edges} == {"formats", "tasks", "search_backends", "trackers"}


def test_every_late_bound_module_function_string_names_a_real_function():
    """The tables' ``"module:function"`` strings are imports the graph does not see: each must name a function or
    class that its module defines, so that a rename or a move fails here, not at a user's first use."""
    modules = module_names()
    found = []
    for path in PACKAGE.rglob("*.py"):
        for module, name in LATE_BOUND.findall(path.read_text()):
            assert module in modules, f"{path.relative_to(REPO)}: {module}:{name} names no module"
            tree = ast.parse(modules[module].read_text())
            defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            assert name in defined, f"{path.relative_to(REPO)}: {module} defines no {name}"
            found.append(f"{module}:{name}")
    assert len(found) >= 26  # the format, task, reward and tracker tables' own


# libraries whose load a verb's ``--help`` or a notebook's ``import hf_tune`` should not pay for
HEAVY = {"torch", "transformers", "datasets", "peft", "trl", "optuna", "deepspeed", "accelerate", "ray", "mlflow",
         "wandb", "lm_eval", "gguf", "numpy", "pandas", "matplotlib", "huggingface_hub", "safetensors", "evaluate",
         "sklearn", "scipy", "bitsandbytes", "tensorboard", "PIL", "fsspec", "openai", "vllm", "gradio", "pydantic"}


def module_level_imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The hf_tune modules and the third-party top-level packages a module imports when it loads (inside ``if`` and
    ``try`` blocks too, so a guarded import counts as loaded)."""
    own, third = set(), set()
    for statement in ast.parse(path.read_text()).body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            names = ([f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom)
                     and node.module and node.level == 0 else [a.name for a in node.names]
                     if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("hf_tune"):
                    while name not in modules:
                        name = name.rpartition(".")[0]
                    own.add(name)
                else:
                    third.add(name.split(".")[0])
    return own, third


def loads(name: str, direct: dict[str, tuple[set[str], set[str]]]) -> tuple[set[str], set[str]]:
    """Every hf_tune module and heavy library that importing ``name`` loads (its packages' ``__init__`` too)."""
    seen, libraries, stack = set(), set(), [name]
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        own, third = direct[module]
        libraries |= third & HEAVY
        stack.extend(own | {module.rsplit(".", k)[0] for k in range(1, module.count("."))})
    return seen, libraries


def unexplained_inner_imports(modules: dict[str, Path], root: Path = REPO) -> list[str]:
    """Function-level imports of hf_tune modules with neither reason: the module imported loads no heavy library that
    the importer's module level does not, and does not load the importer (no cycle to break)."""
    direct = {name: module_level_imports(path, modules) for name, path in modules.items()}
    found = []
    for name, path in modules.items():
        own_modules, own_libraries = loads(name, direct)
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                targets = direct_imports_of_node(node, modules)
                reasons = [target for target in targets if target != name and (
                    name in loads(target, direct)[0] or loads(target, direct)[1] - own_libraries)]
                if targets and not reasons:
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {', '.join(sorted(targets))}")
    return sorted(set(found))


def direct_imports_of_node(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    names = ([f"{node.module}.{alias.name}" for alias in node.names] if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith("hf_tune") else [alias.name for alias in node.names
                                                                 if alias.name.startswith("hf_tune")]
             if isinstance(node, ast.Import) else [])
    found = set()
    for target in names:
        while target not in modules:
            target = target.rpartition(".")[0]
        found.add(target)
    return found


def test_a_function_level_import_of_hf_tune_breaks_a_cycle_or_defers_a_heavy_library():
    assert unexplained_inner_imports(module_names()) == []


def test_the_inner_import_check_finds_one_with_no_reason(tmp_path):
    files = {"hf_tune.light": "import json\n", "hf_tune.heavy": "import torch\n",
             "hf_tune.user": "def f():\n    import hf_tune.light\n\ndef g():\n    from hf_tune import heavy\n"}
    modules = {}
    for name, text in files.items():
        modules[name] = tmp_path.joinpath(*name.split(".")).with_suffix(".py")
        modules[name].parent.mkdir(parents=True, exist_ok=True)
        modules[name].write_text(text)
    assert unexplained_inner_imports(modules, tmp_path) == ["hf_tune/user.py:2 imports hf_tune.light"]
