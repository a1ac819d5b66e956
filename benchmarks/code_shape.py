"""The house's figures (#56): modules over 300 lines, functions over 60, and function-level imports of hf_tune
modules, counted over a package folder by its syntax tree.

    python benchmarks/code_shape.py [hf_tune]
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


if __name__ == "__main__":
    for name, value in shape(Path(sys.argv[1] if len(sys.argv) > 1 else "hf_tune")).items():
        print(f"{name}: {value}")
