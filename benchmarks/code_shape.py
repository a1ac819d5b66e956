"""The house's figures (#56): modules over 300 lines, functions over 60, and function-level imports of hf_tune
modules, counted over a package folder by its syntax tree; with ``--climbs RECIPE``, the calls that climb back up
the layer table (docs/architecture.md) while ``train`` runs that recipe for one step: a call from a function of one
row into a function of a higher row (a callback, a late-bound string resolved), counted as distinct
(caller module, callee module) pairs. Run from the repository root:

    python benchmarks/code_shape.py [hf_tune]
    python benchmarks/code_shape.py --climbs recipes/llm_lora.yaml
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def shape(root: Path) -> dict:
    long_modules, long_functions, inner_imports = [], [], set()
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 300:
            long_modules.append((len(text.splitlines()), str(path)))
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.end_lineno - node.lineno + 1 > 60:
                long_functions.append((node.end_lineno - node.lineno + 1, f"{path}:{node.lineno} {node.name}"))
            for sub in ast.walk(node):  # each import once, however deeply nested
                if (isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("hf_tune")) or (
                        isinstance(sub, ast.Import) and any(a.name.startswith("hf_tune") for a in sub.names)):
                    inner_imports.add((str(path), sub.lineno))
    return {"modules over 300 lines": sorted(long_modules, reverse=True),
            "functions over 60 lines": sorted(long_functions, reverse=True),
            "function-level imports of hf_tune modules": len(inner_imports)}


def climbs(recipe: str, out: str) -> list[tuple[str, str]]:
    """The (caller, callee) module pairs of the calls that go up the layer table while one step of ``recipe``
    trains (the nearest hf_tune frame below the callee is the caller)."""
    import threading

    sys.path.insert(0, "tests")
    from test_architecture import ARCHITECTURE, layer_of_each_module, layer_table, module_names

    from hf_tune import load_recipe, train

    layers = layer_of_each_module(layer_table(ARCHITECTURE.read_text()), module_names())
    found = set()

    def profile(frame, event, arg) -> None:
        callee = frame.f_globals.get("__name__", "")
        if event != "call" or callee not in layers:
            return
        caller = frame.f_back
        while caller is not None and caller.f_globals.get("__name__", "") not in layers:
            caller = caller.f_back
        if caller is not None and layers[callee] < layers[caller.f_globals["__name__"]]:
            found.add((caller.f_globals["__name__"], callee))

    loaded = load_recipe(recipe, [f"training.output_dir={out}", "training.max_steps=1", "training.eval_strategy=no",
                                  "training.save_strategy=no", "data.eval_split=null"])
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        train(loaded)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(found)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--climbs"]:
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            pairs = climbs(sys.argv[2], out)
        print("\n".join(f"{caller} -> {callee}" for caller, callee in pairs))
        print(f"calls back up the layer table: {len(pairs)} (caller, callee) module pairs")
    else:
        for name, value in shape(Path(sys.argv[1] if len(sys.argv) > 1 else "hf_tune")).items():
            print(f"{name}: {value}")
