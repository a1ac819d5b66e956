"""The one resolver of the tables' late-bound ``"module:function"`` strings: a table names the code an entry runs
without importing it, so the tables stay pure and each entry's libraries load on first use
(``tests/test_architecture.py`` checks that each string names a real function)."""

from __future__ import annotations

import functools
import importlib
from typing import Any


@functools.cache
def resolve(dotted: str) -> Any:
    """The function or class ``dotted`` (``"package.module:name"``) names, imported now; ``ImportError`` or
    ``AttributeError`` where it is not there (callers that read a user's string turn them into its error)."""
    module, separator, name = dotted.partition(":")
    if not separator or not name:
        raise ImportError(f"{dotted!r} is not 'module:function'")
    return getattr(importlib.import_module(module), name)
