"""The schema of a recipe: our own sections as pydantic models, upstream sections checked against upstream types.

Sections:
  model     -> ``from_pretrained`` arguments plus ``task``                      (ours: ModelSection)
  lora      -> ``peft.LoraConfig`` keyword arguments, verbatim; absent = full fine-tune
  data      -> ``datasets.load_dataset`` arguments plus format / rendering keys   (ours: DataSection)
  training  -> ``transformers.TrainingArguments`` keyword arguments, verbatim
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    """What ``AutoModel*.from_pretrained`` gets (upstream names), plus the task head."""

    pretrained_model_name_or_path: str = Field(
        description="Hub id, local folder, or an embedded model: embedded:SmolLM2-135M-Instruct, embedded:all-MiniLM-L6-v2"
    )
    task: Literal["causal_lm", "sequence_classification"] = "causal_lm"
    revision: str | None = None
    gguf_file: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    num_labels: PositiveInt | None = None


class DatasetSource(_Section):
    """Arguments of ``datasets.load_dataset`` (upstream names). ``path`` may also be a local .jsonl/.json/.csv/.parquet/.txt file."""

    path: str
    name: str | None = None
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    data_dir: str | None = None
    split: str = "train"
    revision: str | None = None


class DataSection(_Section):
    """Where the examples come from and how they become tokens."""

    train: DatasetSource
    eval: DatasetSource | None = None
    eval_split: float | None = Field(default=None, gt=0, lt=1, description="fraction of train held out for eval")
    format: Literal["chat", "instruction", "prompt_completion", "text"] = "chat"
    max_length: PositiveInt = 1024
    chat_template: str | None = Field(
        default=None, description="Jinja template text or a path to a .jinja file; default: the tokenizer's own"
    )
    num_proc: PositiveInt | None = Field(default=None, description="processes for tokenization")

    @model_validator(mode="after")
    def _one_eval_source(self) -> "DataSection":
        if self.eval is not None and self.eval_split is not None:
            raise ValueError("set either data.eval (a file or split) or data.eval_split (a fraction of train), not both")
        return self


SECTIONS = ("model", "lora", "data", "training")
