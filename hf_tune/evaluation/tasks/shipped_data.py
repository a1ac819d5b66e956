"""The shipped tasks' examples, read from the JSONL files beside their YAML (lm-eval's ``custom_dataset``)."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent


def load_arithmetic(**_metadata):
    """hf_tune_arithmetic's examples as a ``DatasetDict`` with one ``test`` split."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / "hf_tune_arithmetic.jsonl")})


def load_chat_skills(**_metadata):
    """hf_tune_chat_skills' examples as a ``DatasetDict`` with one ``test`` split."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / "hf_tune_chat_skills.jsonl")})


def load_persona(**_metadata):
    """hf_tune_persona's examples as a ``DatasetDict`` with one ``test`` split."""
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / "hf_tune_persona.jsonl")})
