"""The package tells the truth: its declared dependencies cover what hf_tune imports, `hf-tune --version` answers,
the LICENSE is the Apache-2.0 text pyproject names, and the caches follow HF_TUNE_CACHE, then XDG_CACHE_HOME."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib

import launch
import torch
from conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def imported_modules() -> set[str]:
    """Top-level modules that hf_tune's source imports (anywhere in a file), outside the standard library."""
    found = set()
    for path in (REPO / "hf_tune").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "hf_tune"}


def test_every_imported_package_is_declared_and_the_direct_ones_are_required():
    project = PYPROJECT["project"]
    required = {_name(r) for r in project["dependencies"]}
    optional = {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in imported_modules():
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        if names and not names & (required | optional):
            undeclared[module] = sorted(names)
    assert not undeclared  # each import comes from a package pyproject.toml names
    for name in ("huggingface-hub", "numpy", "pandas", "pyarrow", "sqlalchemy", "jinja2", "requests"):
        assert name in required and any(_name(r) == name and ">=" in r for r in project["dependencies"]), name
    assert "bench" not in project["optional-dependencies"]


def test_hf_tune_version_prints_the_installed_version():
    done = launch.run("hf-tune", "--version", timeout=120)
    assert done.returncode == 0
    assert done.stdout.strip() == f"hf-tune {importlib.metadata.version('hf_tune')}"


def test_the_license_is_the_apache_2_text_pyproject_names():
    text = (REPO / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_caches_follow_hf_tune_cache_then_xdg_cache_home(tmp_path, monkeypatch):
    from hf_tune.model.embedded import cache_dir
    from hf_tune.trainer.peak_flops import measured_peak_flops
    from hf_tune.trainer.reference import reference_cache_dir

    monkeypatch.delenv("HF_TUNE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "hf_tune"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "hf_tune"
    assert reference_cache_dir() == tmp_path / "xdg" / "hf_tune" / "reference_logps"
    measured_peak_flops(torch.device("cpu"), torch.float32)
    assert (tmp_path / "xdg" / "hf_tune" / "peak_flops.json").is_file()  # the measured peak, cached where XDG says
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "scratch"))
    assert cache_dir() == tmp_path / "scratch" and reference_cache_dir() == tmp_path / "scratch" / "reference_logps"
    assert not (tmp_path / "home").exists()
