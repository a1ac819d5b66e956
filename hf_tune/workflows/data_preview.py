"""``hf-tune data RECIPE``: the first training examples as the model reads them, the trained tokens marked, with the
counts that decide a run's shape (tokens per example, examples per pack, tokens per optimizer step, the share of
tokens the loss ignores). The data is read and tokenized exactly as training reads it (``plan``'s path), so what is
shown is what trains; a TRL method's rows are shown in TRL's layout, which its trainer tokenizes.
"""

from __future__ import annotations

import json

from hf_tune.catalog.agents import rollout_prompt
from hf_tune.data.preview import IGNORE, first_examples, marked_text
from hf_tune.model.loading import build_tokenizer
from hf_tune.recipe.schema import Recipe
from hf_tune.training_args import build_training_arguments


def masked_share(train) -> float | None:
    """The share of the training tokens whose label is -100 (prompts, padding of a template's markers...)."""
    if "labels" not in train.column_names:
        return None
    total = ignored = 0
    for labels in train["labels"]:
        if not isinstance(labels, list):  # a class id
            return None
        for example in (labels if labels and isinstance(labels[0], list) else [labels]):
            total += len(example)
            ignored += sum(label == IGNORE for label in example)
    return ignored / total if total else None


def data_preview(recipe: Recipe, count: int = 3, colour: bool = False) -> str:
    """The report ``hf-tune data`` prints."""
    from hf_tune.workflows.plan import example_tokens, plan_data

    args = build_training_arguments(recipe)
    data, missing, processor = plan_data(recipe, args)
    if data is None:
        return f"data not read: {missing}"
    train = data.train
    lines = [f"format: {recipe.data.format}   method: {recipe.method}"]
    if recipe.data.streaming:
        lines.append("streamed: the first examples of the stream")
    else:
        lines.append(f"training rows: {len(train)}" + (" (packs)" if recipe.data.batch_tokens else ""))
    tokens = example_tokens(train, processor, recipe) if not recipe.data.streaming else None
    if tokens:
        lines.append(f"tokens per example: mean {tokens['mean']:.1f}, max {tokens['max']}"
                     + (f"; {tokens['examples']} examples in {tokens['packs']} packs, "
                        f"{tokens['examples_per_pack']:.1f} a pack" if tokens.get("packs") else ""))
    step = args.gradient_accumulation_steps * args.world_size
    if recipe.data.batch_tokens:
        lines.append(f"per optimizer step: {step} pack(s) of up to {recipe.data.batch_tokens:,} tokens "
                     f"(up to {step * recipe.data.batch_tokens:,} tokens)")
    elif tokens:
        rows = args.per_device_train_batch_size * step
        lines.append(f"per optimizer step: {rows} examples, about {rows * tokens['mean']:,.0f} tokens")
    share = masked_share(train) if not recipe.data.streaming else None
    if share is not None:
        lines.append(f"tokens the loss ignores: {share:.1%} (the prompt side; the rest, marked below, trains)")
    for number, example in enumerate(first_examples(train, count), start=1):
        lines.append(f"\n--- example {number} " + "-" * 40)
        if recipe.agent and processor is None:  # TRL tokenizes a method's data itself: the tokenizer, loaded once
            processor = build_tokenizer(recipe)
        lines.append(_rollout_start(example, processor, recipe, args) if recipe.agent else
                     _shown(example, processor, colour, data.labels))
    return "\n".join(lines)


def _rollout_start(example: dict, tokenizer, recipe: Recipe, args) -> str:
    """A GRPO example with the ``agent`` section: its prompt rendered with its tools, as the first turn of a rollout
    reads it, and the columns its environment's ``reset`` and the rewards receive."""
    prompt, tools = rollout_prompt(recipe.agent, example)
    text = tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=False)
    count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    columns = {key: value for key, value in example.items() if key != "prompt"}
    return (f"{text}\n({count} tokens; the model writes from here, up to "
            f"{args.max_completion_length} tokens with its tool turns; tools: "
            f"{', '.join(getattr(tool, '__name__', str(tool)) for tool in tools)})"
            + (f"\ncolumns: {json.dumps(columns, ensure_ascii=False, default=str)}" if columns else ""))


def _shown(example: dict, processor, colour: bool, names: list[str] | None = None) -> str:
    tokenizer = getattr(processor, "tokenizer", processor)
    if "input_ids" in example and tokenizer is not None:
        ids = example["input_ids"]
        labels = example.get("labels")
        if isinstance(labels, list) and len(labels) == len(ids):
            text = marked_text(tokenizer, ids, labels, colour)
            return f"{text}\n({len(ids)} tokens, {sum(label != IGNORE for label in labels)} trained)"
        shown = tokenizer.decode(ids, skip_special_tokens=False)
        label = example.get("labels", example.get("label"))
        return shown + (f"\nlabel: {_label(label, names)}" if label is not None else "") + f"\n({len(ids)} tokens)"
    return "\n".join(f"{key}: {_label(value, names)}" if key in ("labels", "label") else _field(key, value)
                     for key, value in example.items())


def _label(label, names: list[str] | None) -> str:
    return f"{label} ({names[label]})" if names and isinstance(label, int) and 0 <= label < len(names) else str(label)


def _field(key: str, value) -> str:
    """One column of a row TRL tokenizes itself: a conversation turn by turn, anything else as JSON."""
    if hasattr(value, "size") and hasattr(value, "mode"):  # a decoded image
        return f"{key}: image {value.size[0]}x{value.size[1]} {value.mode}"
    if isinstance(value, list) and value and all(isinstance(turn, dict) and "role" in turn for turn in value):
        return f"{key}:\n" + "\n".join(f"  {turn['role']}: {turn.get('content')}" for turn in value)
    return f"{key}: {value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)}"
