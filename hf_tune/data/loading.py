"""Raw examples from local files or the Hub, through ``datasets.load_dataset``."""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, load_dataset

from hf_tune.errors import RecipeError
from hf_tune.recipe.loading import LOCAL_DATA_SUFFIXES
from hf_tune.recipe.schema import DataSection, DatasetSource


def load_source(source: DatasetSource, key: str) -> Dataset:
    """``load_dataset(**source)``, where a local .jsonl/.json/.csv/.parquet/.txt ``path`` selects its builder."""
    kwargs = source.model_dump(exclude_none=True)
    path = kwargs.pop("path")
    suffix = Path(path).suffix
    if suffix in LOCAL_DATA_SUFFIXES and Path(path).is_file():
        kwargs["data_files"], path = path, LOCAL_DATA_SUFFIXES[suffix]
    try:
        return load_dataset(path, **kwargs)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as err:
        raise RecipeError(
            key, f"load_dataset({path!r}) failed: {str(err).splitlines()[0]}",
            fix="use a local file (path: data/train.jsonl) or a Hub dataset already in the local cache",
        ) from None


def load_raw_datasets(data: DataSection, seed: int) -> tuple[Dataset, Dataset | None]:
    """Train and eval examples; ``eval_split`` holds out a seeded fraction of train."""
    train = load_source(data.train, "data.train")
    if data.eval is not None:
        return train, load_source(data.eval, "data.eval")
    if data.eval_split:
        parts = train.train_test_split(test_size=data.eval_split, seed=seed)
        return parts["train"], parts["test"]
    return train, None
