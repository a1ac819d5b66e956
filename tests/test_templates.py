"""Label masks beyond ChatML: for each public template shape (tests/chat_templates.py), the tokens and labels equal
an independent computation that writes the conversation turn by turn from the family's format, without Jinja, and
trains exactly the assistant's output and its end-of-turn token (hf_tune/data/rendering.py)."""

from __future__ import annotations

import logging

import pytest
from chat_templates import QWEN_SYSTEM, family_tokenizer, reference

from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_dataset, tokenize_example
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import DataSection

CHAT = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And if you double that?"},
    {"role": "assistant", "content": "Doubling 5 gives 10."},
]
SYSTEM = {"role": "system", "content": "Answer briefly."}
REASONING = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "reasoning_content": "Add two and three.", "content": "5."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "reasoning_content": "Twice five is ten.", "content": "10."},
]


def chatml_segments(messages, default_system=None):
    segments = []
    if default_system and messages[0]["role"] != "system":
        segments.append((f"<|im_start|>system\n{default_system}<|im_end|>\n", False))
    for m in messages:
        trained = m["role"] == "assistant"
        segments += [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>", trained), ("\n", False)]
    return segments


def llama3_segments(messages):
    segments = [("<|begin_of_text|>", False)]
    for m in messages:
        segments += [(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False),
                     (m["content"].strip() + "<|eot_id|>", m["role"] == "assistant")]
    return segments


def mistral_segments(messages):
    segments = [("<s>", False)]
    for m in messages:
        if m["role"] == "user":
            segments.append((f"[INST] {m['content']} [/INST]", False))
        else:
            segments.append((m["content"] + "</s>", True))
    return segments


def gemma_segments(messages):
    segments = [("<bos>", False)]
    for m in messages:
        role = "model" if m["role"] == "assistant" else m["role"]
        segments += [(f"<start_of_turn>{role}\n", False),
                     (m["content"].strip() + "<end_of_turn>", m["role"] == "assistant"), ("\n", False)]
    return segments


def qwen3_segments(messages, always_think=False):
    """Qwen3: an assistant turn after the last question shows its reasoning in <think> (the last turn always, empty
    when it has none); earlier turns show their answer only. ``always_think``: the training variant."""
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    segments = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            segments += [(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", False)]
            continue
        think = always_think or (i > last_query and (i == len(messages) - 1 or m.get("reasoning_content")))
        body = (f"<think>\n{m.get('reasoning_content', '')}\n</think>\n\n" if think else "") + m["content"]
        segments += [("<|im_start|>assistant\n", False), (body + "<|im_end|>", True), ("\n", False)]
    return segments


CASES = {
    "LLAMA3": (lambda m: llama3_segments(m), [SYSTEM, *CHAT]),
    "MISTRAL": (mistral_segments, CHAT),
    "GEMMA": (gemma_segments, CHAT),
    "QWEN2_5": (lambda m: chatml_segments(m, QWEN_SYSTEM), CHAT),
    "QWEN3": (qwen3_segments, REASONING),
    "QWEN3_TRAINING": (lambda m: qwen3_segments(m, always_think=True), REASONING),
}


@pytest.mark.parametrize("family", list(CASES))
def test_assistant_masks_equal_the_turn_by_turn_reference(smol_tokenizer, family):
    segments_of, messages = CASES[family]
    tokenizer = family_tokenizer(smol_tokenizer, family)
    text, ids, labels = reference(tokenizer, segments_of(messages))
    assert tokenizer.apply_chat_template(messages, tokenize=False) == text  # the reference writes what Jinja writes
    row = tokenize_example({"messages": messages}, tokenizer, "chat", 4096)
    assert (row["input_ids"], row["labels"]) == (ids, labels)
    trained_text = "".join(s for s, trained in segments_of(messages) if trained)
    assert tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX]) == trained_text  # token-exact edges


def test_qwen3_trains_each_turn_as_the_full_rendering_shows_it(smol_tokenizer):
    """Qwen3 rewrites history: rendered alone, the first answer keeps its reasoning; followed by a new question, it
    loses it. The prefix rule cannot hold, so the turns are located in the one full rendering: the first answer is
    trained without its reasoning, the last with it (as the model sees conversations at inference)."""
    tokenizer = family_tokenizer(smol_tokenizer, "QWEN3")
    alone = tokenizer.apply_chat_template(REASONING[:2], tokenize=False)
    full = tokenizer.apply_chat_template(REASONING, tokenize=False)
    assert "Add two and three." in alone and "Add two and three." not in full  # the rewrite
    row = tokenize_example({"messages": REASONING}, tokenizer, "chat", 4096)
    trained = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
    assert trained == "5.<|im_end|><think>\nTwice five is ten.\n</think>\n\n10.<|im_end|>"


def test_qwen3_without_reasoning_still_trains_every_turn(smol_tokenizer):
    """Even without reasoning Qwen3 rewrites: the last turn gets an empty think block that an earlier turn loses."""
    tokenizer = family_tokenizer(smol_tokenizer, "QWEN3")
    _, ids, labels = reference(tokenizer, qwen3_segments(CHAT))
    row = tokenize_example({"messages": CHAT}, tokenizer, "chat", 4096)
    assert (row["input_ids"], row["labels"]) == (ids, labels)
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]).count("<|im_end|>") == 2


def test_a_conversational_prompt_completion_trains_only_the_completion_with_markers(smol_tokenizer):
    tokenizer = family_tokenizer(smol_tokenizer, "QWEN3_TRAINING")
    row = tokenize_example({"prompt": REASONING[:3], "completion": REASONING[3:]}, tokenizer, "prompt_completion", 4096)
    assert tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX]) == \
        "<think>\nTwice five is ten.\n</think>\n\n10.<|im_end|>"


@pytest.mark.parametrize("family, message", [("MISTRAL", "Conversation roles must alternate"),
                                             ("GEMMA", "System role not supported")])
def test_a_template_without_a_system_role_names_the_key_and_its_own_message(smol_tokenizer, family, message):
    from datasets import Dataset

    raw = Dataset.from_list([{"messages": [SYSTEM, *CHAT]}])
    with pytest.raises(HfTuneError, match=rf"data.chat_template: the chat template refused a conversation "
                                          rf"\(system/user/assistant/user/assistant\): {message}.*\n  fix: .*first user"):
        tokenize_dataset(raw, family_tokenizer(smol_tokenizer, family), DataSection(train={"path": "x.jsonl"}),
                         "data.train")


def test_the_rewriting_strategy_is_reported_once(smol_tokenizer, caplog):
    from datasets import Dataset

    tokenizer = family_tokenizer(smol_tokenizer, "QWEN3")
    tokenizer.chat_template += "{#- reported once per template #}"
    with caplog.at_level(logging.INFO, logger="hf_tune.data.rendering"):
        tokenize_dataset(Dataset.from_list([{"messages": REASONING}] * 3), tokenizer,
                         DataSection(train={"path": "x.jsonl"}, max_length=4096), "data.train")
    assert caplog.text.count("rewrites earlier turns") == 1
