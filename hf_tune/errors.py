"""The one error type users see: it names the recipe key and the fix, and the CLI prints it without a traceback."""

from __future__ import annotations


class HfTuneError(Exception):
    """A problem with the user's input or environment, reported as one clear message."""


class RecipeError(HfTuneError):
    """A recipe value is wrong. `key` is the dotted recipe path (e.g. ``training.learning_rate``)."""

    def __init__(self, key: str, problem: str, fix: str | None = None):
        self.key, self.problem, self.fix = key, problem, fix
        text = f"{key}: {problem}" if key else problem
        if fix:
            text += f"\n  fix: {fix}"
        super().__init__(text)

    def __reduce__(self):  # rebuilt from its parts: it crosses processes (raised on every rank, see distributed.py)
        return type(self), (self.key, self.problem, self.fix)
