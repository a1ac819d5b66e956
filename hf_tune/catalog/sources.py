"""Facts about where models and data come from: local files and folders, packaged dataset builders, the Hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

LOCAL_DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "imagefolder"}
OFFLINE_MODEL_FIX = ("without Hub access (or with HF_HUB_OFFLINE=1), point it at a local folder with config.json "
                     "and weights (made by save_pretrained, or `hf download ORG/NAME --local-dir DIR` on a machine "
                     "online), or use embedded:SmolLM2-135M-Instruct / embedded:all-MiniLM-L6-v2")

OFFLINE_DATASET_FIX = ("load it once on a machine online with the same HF_DATASETS_CACHE (e.g. `python -c \"import "
                       "datasets; datasets.load_dataset('ORG/NAME')\"`), or use a local file (path: data/train.jsonl)")


def looks_like_local_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.path.exists(name)


def data_file_patterns(files: Any) -> list[str]:
    """``data_files`` of ``load_dataset`` (a string, a list, or a dict of split -> either) as one list."""
    if files is None:
        return []
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for group in files.values() for f in data_file_patterns(group)]
    return list(files)


def is_hub_dataset_id(path: str) -> bool:
    """A ``data`` source's ``path`` that ``load_dataset`` resolves on the Hub: ``name`` or ``org/name``, neither a
    local file or folder nor a packaged builder (json, csv ...)."""
    return (path not in PACKAGED_BUILDERS and not looks_like_local_path(path) and path.count("/") <= 1
            and Path(path).suffix not in LOCAL_DATA_SUFFIXES)
