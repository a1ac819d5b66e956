"""Raw examples from local files or the Hub, through ``datasets.load_dataset``, checked against ``data.format``.
A file that cannot be read is reported by recipe key, file, line and column, before anything is tokenized."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from datasets import Dataset, load_dataset

from hf_tune.catalog.sources import LOCAL_DATA_SUFFIXES, PACKAGED_BUILDERS, data_file_patterns
from hf_tune.data.images import as_images
from hf_tune.data.validation import check_examples
from hf_tune.errors import RecipeError, describe_exception
from hf_tune.recipe.schema import DataSection, DatasetSource

SOURCE_KEYS = {"columns", "format", "weight", "epochs"}  # hf_tune's keys of a source; the rest go to load_dataset
_LOAD_FIX = "use a local file (path: data/train.jsonl) or a Hub dataset already in the local cache"


def load_source(source: DatasetSource, key: str, format: str | None = None, streaming: bool = False) -> Dataset:
    """``load_dataset(**source)``, where a local .jsonl/.json/.csv/.parquet/.txt ``path`` selects its builder. With
    ``format``, every example is checked against it (``check_examples``). ``streaming``: an ``IterableDataset``,
    read as it is consumed (its rows are not checked ahead)."""
    kwargs = source.model_dump(exclude_none=True, exclude=SOURCE_KEYS)
    if streaming:
        kwargs["streaming"] = True
    path = kwargs.pop("path")
    suffix = Path(path).suffix
    if suffix in LOCAL_DATA_SUFFIXES and Path(path).is_file():
        kwargs["data_files"], path = path, LOCAL_DATA_SUFFIXES[suffix]
    files = local_files(source)
    try:
        dataset = load_dataset(path, **kwargs)
    except Exception as err:  # datasets and Arrow raise many types (even a bare StopIteration for an empty file)
        problem = next((f"{file}: {found}" for file in files if (found := file_problem(file))), None)
        if problem is None:
            raise RecipeError(key, f"load_dataset({path!r}) failed: {describe_exception(err)}", fix=_LOAD_FIX) from err
        raise RecipeError(key, f"{problem}\n  (load_dataset said: {describe_exception(err)})",
                          fix=f"repair the file, or point {key}.path at another file") from err
    if streaming:
        return dataset
    if source.columns:
        dataset = map_columns(dataset, source.columns, key, describe_source(source))
    if format is not None:
        dataset = as_images(dataset, format, files[0].parent if files else None)
        one_jsonl = len(files) == 1 and files[0].suffix == ".jsonl"
        check_examples(dataset, format, key, describe_source(source),
                       line_of=(lambda row: line_of_row(files[0], row)) if one_jsonl else None)
    return dataset


def map_columns(dataset: Dataset, columns: dict[str, str], key: str, where: str) -> Dataset:
    """``columns``: the format's column name -> the dataset's; the dataset's columns take the format's names (a
    column already holding such a name gives way to the one the recipe picks)."""
    missing = [theirs for theirs in columns.values() if theirs not in dataset.column_names]
    if missing:
        raise RecipeError(f"{key}.columns", f"{where} has no column {missing[0]!r}; its columns are "
                          f"{dataset.column_names}", fix="map each of the format's columns to one of these")
    renames = {theirs: ours for ours, theirs in columns.items() if theirs != ours}
    displaced = [ours for ours in renames.values() if ours in dataset.column_names and ours not in renames]
    return dataset.remove_columns(displaced).rename_columns(renames)


def load_raw_datasets(data: DataSection, seed: int, train: Dataset | None = None) -> tuple[Dataset, Dataset | None]:
    """Train and eval examples, checked against ``data.format``; ``eval_split`` holds out a seeded fraction of
    train (after the check, so a bad example is named by its place in the file). ``train``: the training source,
    when the caller has loaded it already."""
    train = train if train is not None else load_source(data.train, "data.train", data.format)
    if data.eval is not None:
        return train, load_source(data.eval, "data.eval", data.format)
    if data.eval_split:
        parts = train.train_test_split(test_size=data.eval_split, seed=seed)
        return parts["train"], parts["test"]
    return train, None


def local_files(source: DatasetSource) -> list[Path]:
    """The local files a source reads: its ``path``, or its ``data_files`` under a packaged builder (json, csv...)."""
    if Path(source.path).is_file():
        return [Path(source.path)]
    if source.path not in PACKAGED_BUILDERS:
        return []
    return [Path(f) for p in data_file_patterns(source.data_files) if "://" not in p
            for f in sorted(glob.glob(os.path.expanduser(p)))]


def describe_source(source: DatasetSource) -> str:
    if Path(source.path).is_file():
        return source.path
    if source.path in PACKAGED_BUILDERS:
        return f"{source.path} files {source.data_files or source.data_dir}"
    return f"dataset {source.path!r} (split {source.split!r})"


def file_problem(file: Path) -> str | None:
    """What makes a local data file unreadable, located to its line and column: empty, not UTF-8 text (a binary
    file), not Parquet, or a JSON Lines line that is not a JSON object. None when none of these is found."""
    with open(file, "rb") as f:
        head = f.read(4)
    if file.suffix == ".parquet":
        return None if head == b"PAR1" else "not a Parquet file (no PAR1 magic bytes: a file of another format?)"
    if file.stat().st_size == 0:
        return "the file is empty: no examples"
    json_lines = file.suffix == ".jsonl" or file.suffix == ".json" and not _is_one_json_document(file)
    blank = True
    with open(file, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return (f"line {number}, column {err.start + 1}: not UTF-8 text (byte {raw[err.start]:#04x}): "
                        "a binary file?")
            blank = blank and not line.strip()
            if json_lines and line.strip():
                problem = _json_line_problem(line)
                if problem:
                    return f"line {number}, {problem}"
    if blank:
        return "the file holds only blank lines: no examples"
    return _json_document_problem(file) if file.suffix == ".json" and not json_lines else None


def _json_line_problem(line: str) -> str | None:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        return f"column {err.colno}: not valid JSON ({err.msg}); expected one JSON object per line"
    if not isinstance(value, dict):
        return f"column 1: expected a JSON object ({{...}}) per line, got a {type(value).__name__}"
    return None


def _json_document_problem(file: Path) -> str | None:
    try:
        json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        return f"line {err.lineno}, column {err.colno}: not valid JSON ({err.msg})"
    return None


def _is_one_json_document(file: Path) -> bool:
    """A .json file holding one document (an array of objects) rather than JSON Lines."""
    with open(file, "rb") as f:
        return f.read(4096).lstrip()[:1] == b"["


def line_of_row(file: Path, row: int) -> int | None:
    """The line of a JSON Lines file holding example ``row`` (0-based; blank lines hold none)."""
    with open(file, "rb") as f:
        seen = -1
        for number, line in enumerate(f, 1):
            seen += bool(line.strip())
            if seen == row:
                return number
    return None
