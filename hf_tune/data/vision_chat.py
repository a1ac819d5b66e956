"""Vision-language conversations (``data.format: vision_chat``): TRL's layout (``messages`` whose content holds
``{"type": "image"}`` / ``{"type": "text"}`` parts) and LLaMA-Factory's ``mllm_demo`` (string content with ``<image>``
markers, or ShareGPT ``conversations``), each with an ``images`` list. Rendered by the processor's chat template,
tokenized with the processor (which expands each image into its image tokens), and trained on the assistant's tokens
only: each assistant turn's tokens are found as the tokens of the conversation up to it minus those of its prompt,
both checked to be prefixes of the whole, so no image token or user token is ever trained.
"""

from __future__ import annotations

import logging
from typing import Any

from datasets import Dataset

from hf_tune.data.formats import check_columns, format_of, row_refusal
from hf_tune.data.images import drawn_images
from hf_tune.data.messages import chat_messages
from hf_tune.data.tokenization import IGNORE_INDEX
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.recipe.schema import DataSection

logger = logging.getLogger(__name__)
IMAGE_MARKER = "<image>"  # LLaMA-Factory's marker in string content


def content_parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as parts: TRL's parts kept (null keys dropped; LLaMA-Factory's text ``value`` read as
    ``text``), a string split at ``<image>`` markers."""
    if isinstance(content, list):
        parts = [{k: v for k, v in part.items() if v is not None} for part in content]
        return [{"type": "text", "text": part["value"]} if part.get("type") == "text" and "text" not in part
                and "value" in part else part for part in parts]
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(str(content).split(IMAGE_MARKER)):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def vision_messages(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation with every content as parts (``messages`` or ShareGPT ``conversations``)."""
    return [{**message, "content": content_parts(message.get("content", ""))}
            for message in chat_messages(example, read_parts=False)]


def count_images(messages: list[dict[str, Any]]) -> int:
    return sum(part.get("type") == "image" for message in messages for part in message["content"])


def messages_problem(messages: Any, images: list) -> str | None:
    """What keeps a conversation from training (roles, parts, images against the markers); None when it fits."""
    if not messages:
        return "no turns"
    for number, message in enumerate(messages, 1):
        if not isinstance(message.get("role"), str):
            return f"turn {number} has no 'role'"
        for part in message["content"]:
            if part.get("type") not in ("text", "image") or part["type"] == "text" and not isinstance(
                    part.get("text"), str):
                return (f"turn {number}: expected parts {{'type': 'text', 'text': ...}} or {{'type': 'image'}}, "
                        f"got {part}")
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn: nothing to train"
    if count_images(messages) != len(images):
        return (f"{count_images(messages)} image places ({IMAGE_MARKER} markers or image parts) but "
                f"{len(images)} images in 'images'")
    return None


def vision_chat_examples(raw: Dataset, processor, data: DataSection, labels: list[str] | None, key: str) -> Dataset:
    """``input_ids`` and ``labels`` (assistant tokens only) from the processor, and ``pixel_values``: the example's
    images, turned into pixels per batch by ``VisionChatCollator``. Examples over ``data.max_length`` are dropped
    (their image tokens cannot be cut) and counted in a warning."""
    check_columns(data.format, raw.column_names, key)
    refuse = row_refusal(data.format, key, "the data", len(raw))
    image_token = getattr(processor, "image_token", None) or IMAGE_MARKER
    image_id = processor.tokenizer.convert_tokens_to_ids(image_token)
    normalize = format_of(data.format).normalize

    def encode(example: dict[str, Any], row: int) -> dict[str, Any]:
        images = [image.convert("RGB") for image in example.get("images") or []]
        messages = normalize(example)  # the format's normaliser: vision_messages
        problem = messages_problem(messages, images)
        if problem:
            refuse(row, "messages" if example.get("messages") is not None else "conversations", problem)
        ids, trained = assistant_tokens(processor, messages, images)
        return {"input_ids": ids, "labels": [t if keep and t != image_id else IGNORE_INDEX
                                             for t, keep in zip(ids, trained)]}

    encoded = raw.map(encode, with_indices=True, remove_columns=[c for c in raw.column_names if c != "images"],
                      desc=f"Tokenizing {key} (vision_chat)")
    if "images" in encoded.column_names:  # named as the model's input, so Trainer keeps the column
        encoded = encoded.rename_column("images", "pixel_values")
    kept = encoded.filter(lambda ids: len(ids) <= data.max_length, input_columns=["input_ids"])
    if len(kept) < len(encoded):
        logger.warning("%s: %d of %d examples are longer than data.max_length (%d tokens) and were dropped", key,
                       len(encoded) - len(kept), len(encoded), data.max_length)
    if not len(kept):
        raise RecipeError(f"{key}", f"every example is longer than data.max_length ({data.max_length})",
                          fix="raise data.max_length, or lower the processor's image size")
    return kept


def assistant_tokens(processor, messages: list[dict[str, Any]], images: list) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and, per token, whether it belongs to an assistant turn: for each assistant turn
    the tokens of the conversation up to it, after those of its prompt (``add_generation_prompt``)."""
    render = processor.apply_chat_template
    text = render(messages, tokenize=False)
    ids = _token_ids(processor, text, images)
    trained = [False] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = render(messages[: i + 1], tokenize=False)
        if not (text.startswith(upto) and upto.startswith(prompt)):
            raise HfTuneError("vision_chat: the processor's chat template renders a conversation differently from "
                              "its prefixes, so the assistant's tokens cannot be told apart; use a processor whose "
                              "template renders each turn in place")
        start = len(_token_ids(processor, prompt, images[:count_images(messages[:i])]))
        end_ids = _token_ids(processor, upto, images[:count_images(messages[: i + 1])])
        if ids[: len(end_ids)] != end_ids or ids[:start] != end_ids[:start]:
            raise HfTuneError("vision_chat: the tokens of a conversation's prefix differ from the start of its "
                              "tokens (a token spans the turn boundary); this processor's template is not supported")
        trained[start: len(end_ids)] = [True] * (len(end_ids) - start)
    return ids, trained


def _token_ids(processor, text: str, images: list) -> list[int]:
    encoded = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
    return list(encoded["input_ids"][0])


class VisionChatCollator:
    """Pads ``input_ids`` (right, with the tokenizer's pad token) and ``labels`` (-100), and runs the processor's
    image processor over each example's images: ``pixel_values`` and what else the model reads with them."""

    def __init__(self, processor):
        self.processor = processor
        tokenizer = processor.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(features), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        images = [[image.convert("RGB") for image in f.get("pixel_values") or []] for f in features]
        if any(images):
            batch.update(self.processor.image_processor(images=images, return_tensors="pt"))
        return batch



def sample_conversations(processor, task) -> dict:
    """Two questions, each about a drawn image, rendered by the processor's chat template and run through the
    processor (image tokens and pixels): the inputs of ``hf-tune merge --check``."""

    questions = ["What is in this picture?", "Describe the colours."]
    turns = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}] for q in questions]
    texts = [processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) for turn in turns]
    return dict(processor(text=texts, images=[[image] for image in drawn_images()], return_tensors="pt",
                          padding=True, add_special_tokens=False))
