"""One ``hf-tune`` sub-command as ``commands/cli.py`` lists it (``Verb``), and the checks of a verb's ``--out`` that
need to know what the verb wrote before."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

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


def written_by_init(path: Path, arguments=None) -> bool:
    """A recipe ``hf-tune init`` wrote (its first line says so): init may write it again."""
    try:
        with path.open(encoding="utf-8") as handle:
            return "written by `hf-tune init`" in handle.readline()
    except (OSError, UnicodeDecodeError):
        return False


def answers_of_this_input(path: Path, arguments) -> bool:
    """``generate``'s answers to this very input (whole or begun): a rerun continues or confirms them."""
    from hf_tune.commands.generate import answers_input

    return answers_input(path, arguments.input)
