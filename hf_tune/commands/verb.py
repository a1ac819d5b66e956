"""One ``hf-tune`` sub-command (``Verb``: each verb's module defines its ``VERB``, ``commands/cli.py`` lists them), the
options several verbs share, and the checks of a verb's ``--out`` that need to know what the verb wrote before."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

from hf_tune.commands.option_types import device_here, number, whole
from hf_tune.runtime.output_paths import Output


def option(*flags: str, **settings) -> tuple[tuple[str, ...], dict]:
    """One argument of a verb, as ``ArgumentParser.add_argument`` takes it."""
    return flags, settings


@dataclasses.dataclass(frozen=True)
class Verb:
    """One ``hf-tune`` sub-command: what it runs, its help line, whether it reads RECIPE [overrides], its options,
    and what its ``--out`` is (checked before the verb does any work: ``runtime/output_paths.py``)."""

    run: Callable[[argparse.Namespace], None]
    help: str
    reads_recipe: bool = False
    options: tuple[tuple[tuple[str, ...], dict], ...] = ()
    output: Output | None = None


RUN_DIR = option("run_dir")
DEVICE = option("--device", type=device_here, default=None, help="default: cuda if available, else mps, else cpu")
DTYPE = option("--dtype", default=None, choices=("auto", "bfloat16", "float16", "float32"),
               help="default: bfloat16 on a GPU that supports it, else float32; auto: the checkpoint's dtype")
GENERATION = (  # chat's and generate's
    option("--max-new-tokens", type=whole(1), default=128),
    option("--temperature", type=number(0), default=0.0, help="0 (default): greedy; above 0: sampled"),
    option("--top-p", type=number(0, 1, low_open=True), default=1.0,
           help="nucleus sampling (with --temperature above 0)"),
    option("--seed", type=whole(0), default=None, help="makes sampled replies repeatable"))
TRACKING_URI = "default: MLFLOW_TRACKING_URI"


def written_by_init(path: Path, arguments=None) -> bool:
    """A recipe ``hf-tune init`` wrote (its first line says so): init may write it again."""
    try:
        with path.open(encoding="utf-8") as handle:
            return "written by `hf-tune init`" in handle.readline()
    except (OSError, UnicodeDecodeError):
        return False


def answers_of_this_input(path: Path, arguments) -> bool:
    """``generate``'s answers to this very input (whole or begun): a rerun continues or confirms them."""
    from hf_tune.workflows.generate import answers_input

    return answers_input(path, arguments.input)
