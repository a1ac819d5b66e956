"""What every command line shares (``hf-tune``, ``python -m hf_tune.run``, ``python -m hf_tune.search``): the recipe
arguments, ``--debug``, INFO logs on standard error, and an ``HfTuneError`` shown as one message with its exit status.
Light: ``hf-tune --help`` imports this and no library."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from hf_tune.errors import HfTuneError
from hf_tune.redaction import redact_urls


def plain_progress_off_a_terminal() -> None:
    """Off a terminal (a log file, a pipe, a scheduler's capture), progress bars are off: a bar redraws its line with
    carriage returns, so a log held one line of every redraw (85 KB for the demo's 20 steps). Trainer then prints
    each log (loss, learning rate, throughput) as a line of its own instead. Read by tqdm at its import, so set
    before any library loads: the entry points (``python -m hf_tune.run``, ``hf-tune``, ``python -m hf_tune.search``)
    call it first; a notebook importing hf_tune keeps its bars. A value the user set is kept."""
    if not sys.stderr.isatty():
        for name in ("TQDM_DISABLE", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
            os.environ.setdefault(name, "1")


DEBUG_HELP = "show the traceback of errors"


def recipe_arguments() -> argparse.ArgumentParser:
    """RECIPE [section.key=value ...]: the arguments of every command that reads a recipe, defined once."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("recipe", help="YAML recipe, e.g. recipes/llm_lora.yaml")
    p.add_argument("overrides", nargs="*", help="section.key=value, value read as YAML (training.max_steps=10)")
    return p


def launcher_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """RECIPE [overrides] and ``--debug`` for a module run under a launcher, which accepts the ``--local_rank`` that
    ``deepspeed --module`` passes."""
    p = argparse.ArgumentParser(prog=prog, description=description, parents=[recipe_arguments()])
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


class _CurrentStderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is logged: a notebook or a test may replace it between runs,
    and a handler bound to an old, closed stream would print logging's own traceback."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler sets it in __init__; the current sys.stderr is used instead
        pass


class RedactingFormatter(logging.Formatter):
    """Every log line with URL credentials masked (``redact_urls``): a library's message may echo a URL whole."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_urls(super().format(record))


def configure_logging() -> None:
    """INFO logs with a time stamp on standard error, set up once per process (entry points call it). The libraries'
    own handlers (bound to the standard error of the moment they were imported) give way to this one."""
    import datasets.utils.logging  # noqa: F401  (configures its library logger now, so it can be redirected)
    import transformers.utils.logging

    transformers.utils.logging.disable_default_handler()
    transformers.utils.logging.enable_propagation()
    library = logging.getLogger("datasets")
    for handler in [h for h in library.handlers if type(h) is logging.StreamHandler]:
        library.removeHandler(handler)
    library.propagate = True
    root = logging.getLogger()
    if not any(isinstance(handler, _CurrentStderr) for handler in root.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache's INFO lines say nothing of the run


@contextlib.contextmanager
def user_errors(debug: bool):
    """Print an HfTuneError as one message and exit with its ``exit_code`` (2: usage or recipe error, 3: the run
    diverged; see hf_tune.errors); ``--debug`` shows the traceback instead, down to the library error it wraps (a
    stage wraps what it raised with ``raise ... from err``)."""
    try:
        yield
    except HfTuneError as err:
        if debug:
            raise
        print(f"hf_tune: error: {redact_urls(str(err))}", file=sys.stderr)
        if err.__cause__ is not None:
            print("  (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
