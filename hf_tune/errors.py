"""The one error type users see: it names the recipe key and the fix, and the CLI prints it without a traceback.

The rule, in one place: every exception raised while building from a recipe either is an ``HfTuneError`` naming the
recipe key, or is turned into one by ``stage_errors`` at the boundary of the stage that raised it (data loading,
tokenization, model building, PEFT wrapping). The original type and first line stay in the message, and the
original exception is chained (``raise ... from err``), so ``--debug`` still shows its traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

EXIT_FAILURE = 1  # any other failure: an unexpected exception (its traceback is printed), Python's own status
EXIT_USAGE = 2  # a usage or recipe error (HfTuneError, RecipeError): argparse's status for a bad command line too
EXIT_DIVERGED = 3  # the run diverged: a training loss was NaN or infinite (NonFiniteLoss)
EXIT_PREEMPTED = 75  # stopped by SIGTERM / SIGUSR1 after saving a complete checkpoint: rerun to resume (EX_TEMPFAIL)


class HfTuneError(Exception):
    """A problem with the user's input or environment, reported as one clear message; the CLI exits with
    ``exit_code`` (a subclass for another kind of failure sets its own)."""

    exit_code: int = EXIT_USAGE


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


def describe_exception(err: BaseException) -> str:
    """``Type: first line`` of an exception, followed by its cause's when it has one (library errors often wrap
    the informative one: datasets' "An error occurred while generating the dataset" wraps Arrow's parse error)."""
    def one(e: BaseException) -> str:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__

    cause = err.__cause__
    return f"{one(err)} (caused by {one(cause)})" if cause is not None else one(err)


@contextlib.contextmanager
def stage_errors(key: str | Callable[[str], str], stage: str, fix: str | None = None) -> Iterator[None]:
    """Inside, an exception that is not an HfTuneError becomes a RecipeError naming ``key`` (or the key that
    ``key(message)`` picks from the error's message): "<key>: <stage> failed: <Type>: <first line>"."""
    try:
        yield
    except HfTuneError:
        raise
    except Exception as err:
        name = key(str(err)) if callable(key) else key
        raise RecipeError(name, f"{stage} failed: {describe_exception(err)}", fix) from err
