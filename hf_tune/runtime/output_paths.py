"""Every path a verb writes, checked before the verb does any work: a folder where a file goes (or the reverse), a
place that cannot be written, the verb's own input, or a file the verb did not write (another job's answers, a
user's file) is refused with the fix, and nothing is written. ``hf-tune``'s dispatcher checks each verb's ``--out``
here (``commands/cli.py``: a verb's ``Output``); the library calls behind the verbs use it for their defaults."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from hf_tune.errors import HfTuneError


@dataclasses.dataclass(frozen=True)
class Output:
    """What a verb's output path is: a ``file`` or a ``folder``; ``ours(path, arguments)``: whether an existing file
    is one this verb wrote for these arguments (it may then be replaced or continued), None where an existing file is
    never replaced; ``inputs``: the names of the verb's arguments it reads, which its output must not be."""

    kind: str
    ours: Callable[[Path, object], bool] | None = None
    inputs: tuple[str, ...] = ()
    flag: str = "--out"


def check_output(path: str | os.PathLike, output: Output, inputs: Sequence[str | os.PathLike | None] = (),
                 arguments: object = None) -> Path:
    """``path`` as the verb may write it, or ``HfTuneError`` (exit 2) naming the flag, the problem and the fix.
    ``inputs``: the paths the verb reads; ``arguments``: what ``Output.ours`` is given beside the path."""
    path, flag = Path(path).expanduser(), output.flag
    for source in inputs:
        if source is not None and _same(path, Path(source).expanduser()):
            raise _refused(flag, path, "is this command's own input", "write to another path: the input is read, "
                           "never written")
    if output.kind == "file":
        if path.is_dir():
            raise _refused(flag, path, "is a folder, and a file goes there", f"name a file, e.g. {path / 'NAME'}")
        if path.exists() and not (output.ours and output.ours(path, arguments)):
            raise _refused(flag, path, "exists and is not a file this command wrote (it is never overwritten)",
                           "choose another path, or move the file away first")
    elif path.exists() and not path.is_dir():
        raise _refused(flag, path, "is a file, and a folder goes there", "name a folder (it is created if needed)")
    _writable(path, flag)
    return path


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _writable(path: Path, flag: str) -> None:
    """The nearest existing folder at or above the path must take a new file (a real try: permissions, a
    read-only file system, a file in the way)."""
    probe = path if path.is_dir() else path.parent
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise _refused(flag, path, f"lies under {probe}, a file", "name a path inside a folder")
    try:
        handle, name = tempfile.mkstemp(dir=probe, prefix=".hf_tune-write-check-")
        os.close(handle)
        os.unlink(name)
    except OSError as err:
        raise _refused(flag, path, f"cannot be written: {probe} refuses a new file ({err.strerror or err})",
                       "choose a folder you can write to") from None


def _refused(flag: str, path: Path, problem: str, fix: str) -> HfTuneError:
    return HfTuneError(f"{flag} {path}: {problem}\n  fix: {fix}")  # a usage error: exit 2


def starts_with(*markers: bytes) -> Callable[[Path, object], bool]:
    """An existing file is ours where it begins with one of ``markers`` (a format's magic, a header we write)."""
    def ours(path: Path, arguments: object = None) -> bool:
        try:
            with path.open("rb") as handle:
                head = handle.read(max(map(len, markers)))
        except OSError:
            return False
        return any(head.startswith(marker) for marker in markers)
    return ours
