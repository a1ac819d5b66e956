"""The format table: every ``data.format`` with its columns, help, normaliser and readers. A new format is one entry
here plus its normaliser; the rest of hf_tune looks the format up instead of naming it. Pure: the normaliser is a
``module:function`` path, imported when first asked for (the schema's ``Literal`` is built from this table).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hf_tune.catalog.late_bound import resolve


@dataclasses.dataclass(frozen=True)
class Column:
    """A column a format reads. ``kind`` (sft formats, checked on Arrow before tokenizing): string, turns (a list of
    messages), string|turns, label, image (every image opened and decoded); None where the normaliser checks the rows
    itself. ``optional``: may be absent or null."""

    name: str
    kind: str | None = None
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class Format:
    """One ``data.format``: what its examples hold, how they become what a trainer reads, and who reads them."""

    name: str
    layouts: tuple[tuple[str, ...], ...]  # column sets, one of which the data holds (the first whose first is there)
    columns: tuple[Column, ...]  # every column it reads: checked per row, and replaced by the normalised example
    help: str  # what the examples hold, in one line (errors, docs)
    normalizer: str | None  # "module:function": a raw example -> what its trainer reads; None: read as it is
    tasks: tuple[str, ...] = ()  # the model.task values that train on it (Task.formats; reward_model: the pairs)
    mixable: bool = False  # becomes input_ids + labels: may be mixed with other such formats, and streamed
    chat_template: bool = False  # always rendered by the tokenizer's chat template (which must exist)
    string_follows: tuple[str, str] | None = None  # (a, b): where column a holds a string, b must hold one too
    class_labels: bool = False  # each example has a class label: class names from the data, stratified folds
    sequences: int = 1  # sequences a TRL trainer builds per example (chosen and rejected: 2)

    @property
    def normalize(self) -> Callable[[dict[str, Any]], Any]:
        """The normaliser, imported on first use (it may need datasets or TRL's helpers)."""
        return resolve(self.normalizer)

    def layout(self, columns: list[str]) -> tuple[str, ...]:
        """The column set the data is read with: the first layout whose first column is there, else the first."""
        return next((layout for layout in self.layouts if layout[0] in columns), self.layouts[0])

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(column.name for column in self.columns)


_TEXT, _TURNS, _EITHER = "string", "turns", "string|turns"
FORMATS = {f.name: f for f in (
    Format("chat", (("messages",), ("conversations",)), (Column("messages", _TURNS), Column("conversations", _TURNS)),
           "a 'messages' list of {role, content} turns, or a ShareGPT 'conversations' list of {from, value} turns",
           "hf_tune.data.formats:chat_example", ("causal_lm",), mixable=True,
           chat_template=True),
    Format("instruction", (("instruction", "output"),),
           (Column("instruction", _TEXT), Column("output", _TEXT), Column("input", _TEXT, True),
            Column("system", _TEXT, True)),
           "'instruction' and 'output' strings, optional 'input' and 'system' strings",
           "hf_tune.data.formats:instruction_example", ("causal_lm",), mixable=True, chat_template=True),
    Format("prompt_completion", (("prompt", "completion"),), (Column("prompt", _EITHER), Column("completion", _EITHER)),
           "'prompt' and 'completion': strings, or lists of {role, content} messages",
           "hf_tune.data.formats:prompt_completion_example", ("causal_lm",), mixable=True,
           string_follows=("prompt", "completion")),
    Format("text", (("text",),), (Column("text", _TEXT),), "a 'text' string", "hf_tune.data.formats:text_example",
           ("causal_lm",), mixable=True),
    Format("classification", (("text", "label"),),
           (Column("text", _TEXT), Column("text_pair", _TEXT, True), Column("label", "label")),
           "a 'text' string (optional 'text_pair'), and a 'label': a class name or an integer id", None,
           ("sequence_classification",), class_labels=True),
    Format("image_classification", (("image", "label"),), (Column("image", "image"), Column("label", "label")),
           "an 'image' (an image file's path, relative to the data file's folder, or an image feature) and a "
           "'label': a class name or an integer id; datasets' imagefolder gives both",
           None, ("image_classification",), class_labels=True),
    Format("vision_chat", (("messages",), ("conversations",)),
           (Column("messages"), Column("conversations"), Column("images", "images", True)),
           "'messages' whose content holds {'type': 'image'} / {'type': 'text', 'text': ...} parts (TRL), or string "
           "content with <image> markers (LLaMA-Factory's mllm_demo), or ShareGPT 'conversations'; and an 'images' "
           "list (file paths relative to the data file's folder, or image features), one per image place",
           "hf_tune.data.vision_chat:vision_messages", ("image_text_to_text",)),
    Format("preference", (("chosen", "rejected"),),
           tuple(Column(c) for c in ("prompt", "chosen", "rejected", "conversations", "system", "instruction",
                                     "input")),
           "'prompt', 'chosen' and 'rejected' (strings or lists of {role, content} messages); or only 'chosen' and "
           "'rejected' conversations; or LLaMA-Factory's 'conversations' with 'chosen' / 'rejected' messages",
           "hf_tune.data.preference:preference_row", ("reward_model",), sequences=2),
    Format("unpaired_preference", (("prompt", "completion", "label"), ("messages", "label")),
           tuple(Column(c) for c in ("prompt", "completion", "label", "messages")),
           "'prompt', 'completion' (strings or messages) and a boolean 'label' (true: desirable); or LLaMA-Factory's "
           "'messages' ending in the assistant's answer, and 'label'",
           "hf_tune.data.preference:unpaired_row"),
    Format("prompt_only", (("prompt",),), (Column("prompt"),),
           "a 'prompt' (a string or a list of {role, content} messages), plus the columns the rewards read",
           "hf_tune.data.preference:prompt_row"),
)}
DEFAULT_FORMAT = next(iter(FORMATS))  # data.format's default with method sft


def format_of(name: str | None) -> Format:
    """The format by name (None, as in a recipe written before formats were named, is the default)."""
    return FORMATS[name or DEFAULT_FORMAT]


def format_names(**wanted: Any) -> tuple[str, ...]:
    """Names of the formats whose fields have the wanted values, in table order: ``format_names(mixable=True)``."""
    return tuple(name for name, f in FORMATS.items() if all(getattr(f, k) == v for k, v in wanted.items()))


def formats_trained_by(task: str) -> tuple[str, ...]:
    """The formats a model.task trains on."""
    return tuple(name for name, f in FORMATS.items() if task in f.tasks)
