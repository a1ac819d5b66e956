"""Examples as the model reads them: decoded, the trained tokens (label not -100) marked; the first examples of a
training set, out of their packs. ``hf-tune data`` shows them, and a run logs its first one."""

from __future__ import annotations

from hf_tune.recipe.schema import Recipe

IGNORE = -100  # a label the loss skips
COLOUR = ("\x1b[1;32m", "\x1b[0m")  # trained tokens in a terminal: bold green
MARKERS = ("[[", "]]")  # elsewhere: trained text between double brackets


def marked_text(tokenizer, input_ids: list[int], labels: list[int], colour: bool = False) -> str:
    """The example decoded run by run of tokens, each run of trained tokens (label not -100) marked."""
    opening, closing = COLOUR if colour else MARKERS
    pieces, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or (labels[end] != IGNORE) != (labels[start] != IGNORE):
            text = tokenizer.decode(input_ids[start:end], skip_special_tokens=False)
            pieces.append(f"{opening}{text}{closing}" if labels[start] != IGNORE else text)
            start = end
    return "".join(pieces)


def first_examples(train, count: int) -> list[dict]:
    """The first ``count`` examples, taken out of their packs where the rows are packs."""
    examples = []
    for row in train:
        packed = isinstance(row.get("input_ids"), list) and row["input_ids"] and isinstance(row["input_ids"][0], list)
        if packed:
            examples += [{key: row[key][i] for key in row} for i in range(len(row["input_ids"]))]
        else:
            examples.append(row)
        if len(examples) >= count:
            break
    return examples[:count]


def first_example_for_the_log(recipe: Recipe, train, tokenizer) -> str | None:
    """The first training example with its trained tokens marked, for the log at the start of training (None for a
    stream, which is not read ahead, and for rows without labels: a TRL method's, a classifier's)."""
    if recipe.data.streaming or "labels" not in train.column_names or tokenizer is None:
        return None
    example = first_examples(train, 1)[0]
    if not isinstance(example["labels"], list):
        return None
    return marked_text(getattr(tokenizer, "tokenizer", tokenizer), example["input_ids"], example["labels"])
