"""Facts about where models and data come from: local files and folders, packaged dataset builders, the Hub."""

from __future__ import annotations

import os
from typing import Any

LOCAL_DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow"}
OFFLINE_MODEL_FIX = ("without Hub access (or with HF_HUB_OFFLINE=1), point it at a local folder with config.json "
                     "and weights (made by save_pretrained, or `hf download ORG/NAME --local-dir DIR` on a machine "
                     "online), or use embedded:SmolLM2-135M-Instruct / embedded:all-MiniLM-L6-v2")


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
