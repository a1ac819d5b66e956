"""Data: for each format, tokens and label mask equal an independent turn-by-turn ChatML computation."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import DATA

from hf_tune.data.loading import load_raw_datasets, load_source
from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_dataset, tokenize_example, tokenizer_fingerprint
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import DataSection, DatasetSource

SMOL_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CONVERSATION = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And if you double that?"},
    {"role": "assistant", "content": "Doubling 5 gives 10."},
]


def chatml_reference(tokenizer, messages):
    """Tokens and labels built segment by segment from the ChatML spec, without the chat template: each turn is
    '<|im_start|>ROLE\\n' + content + '<|im_end|>' + '\\n', and only an assistant's content + '<|im_end|>' is trained."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": SMOL_DEFAULT_SYSTEM}, *messages]
    ids, labels = [], []

    def add(text, trained):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        labels.extend(piece if trained else [IGNORE_INDEX] * len(piece))

    for m in messages:
        trained = m["role"] == "assistant"
        add(f"<|im_start|>{m['role']}\n", False)
        add(m["content"], trained)
        add("<|im_end|>", trained)
        add("\n", False)
    return ids, labels


def tokenize(tokenizer, example, format, max_length=1024):
    row = tokenize_example(example, tokenizer, format, max_length)
    assert row["attention_mask"] == [1] * len(row["input_ids"])
    return row["input_ids"], row["labels"]


def test_chat_multi_turn_labels_only_assistant_turns_with_their_end_of_turn(smol_tokenizer):
    ids, labels = tokenize(smol_tokenizer, {"messages": CONVERSATION}, "chat")
    assert (ids, labels) == chatml_reference(smol_tokenizer, CONVERSATION)
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == smol_tokenizer.pad_token_id  # pad = eos: masking must not come from "input != pad"
    trained_ends = [i for i, (t, lab) in enumerate(zip(ids, labels)) if t == im_end and lab == im_end]
    assert len(trained_ends) == 2  # one per assistant turn; system and user ends stay -100
    assert smol_tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "2 + 3 = 5.<|im_end|>Doubling 5 gives 10.<|im_end|>"


def test_chat_with_system_message(smol_tokenizer):
    messages = [{"role": "system", "content": "Answer briefly."}, *CONVERSATION[:2]]
    assert tokenize(smol_tokenizer, {"messages": messages}, "chat") == chatml_reference(smol_tokenizer, messages)


def test_sharegpt_conversations_map_to_the_same_tokens(smol_tokenizer):
    roles = {"user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in CONVERSATION]}
    assert tokenize(smol_tokenizer, sharegpt, "chat") == chatml_reference(smol_tokenizer, CONVERSATION)


@pytest.mark.parametrize("input_text, user_text", [("", "Name the capital of France."),
                                                    ("France", "Name the capital of France.\n\nFrance")])
def test_instruction_format_is_a_user_assistant_exchange(smol_tokenizer, input_text, user_text):
    example = {"instruction": "Name the capital of France.", "input": input_text, "output": "Paris."}
    expected = chatml_reference(smol_tokenizer, [{"role": "user", "content": user_text},
                                                 {"role": "assistant", "content": "Paris."}])
    assert tokenize(smol_tokenizer, example, "instruction") == expected


def test_plain_prompt_completion_trains_completion_and_eos(smol_tokenizer):
    ids, labels = tokenize(smol_tokenizer, {"prompt": "The capital of Peru is", "completion": " Lima."}, "prompt_completion")
    prompt = smol_tokenizer("The capital of Peru is")["input_ids"]
    completion = smol_tokenizer(" Lima.", add_special_tokens=False)["input_ids"] + [smol_tokenizer.eos_token_id]
    assert ids == prompt + completion
    assert labels == [IGNORE_INDEX] * len(prompt) + completion


@pytest.mark.parametrize("completion", [[CONVERSATION[3]], CONVERSATION[3]["content"]], ids=["messages", "string"])
def test_conversational_prompt_completion_trains_the_completion_only(smol_tokenizer, completion):
    """As TRL's completion-only loss: everything up to the prompt rendered with the generation prompt is context,
    the assistant turn inside the prompt included; the completion and its end-of-turn token are trained."""
    ids, labels = tokenize(smol_tokenizer, {"prompt": CONVERSATION[:3], "completion": completion}, "prompt_completion")
    reference_ids, _ = chatml_reference(smol_tokenizer, CONVERSATION)
    prompt = smol_tokenizer.apply_chat_template(CONVERSATION[:3], tokenize=False, add_generation_prompt=True)
    prompt_ids = smol_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids == reference_ids and ids[:len(prompt_ids)] == prompt_ids
    newline = smol_tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert ids[-1:] == newline  # the template's newline after the last end-of-turn token: not trained
    assert labels == [IGNORE_INDEX] * len(prompt_ids) + ids[len(prompt_ids):-1] + [IGNORE_INDEX]
    assert smol_tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "Doubling 5 gives 10.<|im_end|>"


def test_text_trains_every_token_and_ends_with_eos(smol_tokenizer):
    ids, labels = tokenize(smol_tokenizer, {"text": "Owls hunt at night."}, "text")
    assert ids == smol_tokenizer("Owls hunt at night.")["input_ids"] + [smol_tokenizer.eos_token_id]
    assert labels == ids


def test_truncation_keeps_max_length_tokens(smol_tokenizer):
    ids, labels = tokenize(smol_tokenizer, {"messages": CONVERSATION}, "chat", max_length=40)
    full_ids, full_labels = chatml_reference(smol_tokenizer, CONVERSATION)
    assert (ids, labels) == (full_ids[:40], full_labels[:40])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_examples_without_trainable_tokens_are_dropped_and_counted(tmp_path, smol_tokenizer, caplog):
    short = {"messages": CONVERSATION[:2]}
    long = {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    data = DataSection(train={"path": str(write_jsonl(tmp_path / "d.jsonl", [short, long, short]))}, max_length=64)
    raw, _ = load_raw_datasets(data, seed=0)
    with caplog.at_level(logging.WARNING):
        tokenized = tokenize_dataset(raw, smol_tokenizer, data, "data.train")
    assert len(tokenized) == 2
    assert "dropped 1 of 3" in caplog.text

    only_long = DataSection(train={"path": str(write_jsonl(tmp_path / "l.jsonl", [long]))}, max_length=64)
    raw, _ = load_raw_datasets(only_long, seed=0)
    with pytest.raises(HfTuneError, match="no trainable token"):
        tokenize_dataset(raw, smol_tokenizer, only_long, "data.train")


def test_wrong_columns_for_the_format_name_the_file_and_the_fix(tmp_path, smol_tokenizer):
    from datasets import Dataset

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "hi"}])
    data = DataSection(train={"path": str(path)}, format="chat")
    with pytest.raises(HfTuneError, match=rf"data.train: format 'chat' needs .*; {path} has \['text'\]\n  fix: set "
                                          "data.format"):
        load_raw_datasets(data, seed=0)
    with pytest.raises(HfTuneError, match="data.train: format 'chat' needs"):  # a dataset made in a notebook
        tokenize_dataset(Dataset.from_list([{"text": "hi"}]), smol_tokenizer, data, "data.train")


def test_eval_split_is_a_seeded_fraction(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"example {i}"} for i in range(40)])
    data = DataSection(train={"path": str(path)}, format="text", eval_split=0.25)
    train, evaluation = load_raw_datasets(data, seed=3)
    again, evaluation_again = load_raw_datasets(data, seed=3)
    assert len(train) == 30 and len(evaluation) == 10
    assert evaluation["text"] == evaluation_again["text"]
    assert not set(train["text"]) & set(evaluation["text"])


def test_a_changed_tokenizer_never_reuses_a_stale_tokenization_cache(tmp_path, smol_tokenizer):
    import copy

    data = DataSection(train={"path": str(write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}]))})
    raw, _ = load_raw_datasets(data, seed=0)
    first = tokenize_dataset(raw, smol_tokenizer, data, "data.train")
    again = tokenize_dataset(raw, smol_tokenizer, data, "data.train")
    assert again._fingerprint == first._fingerprint  # same inputs: the cache is reused
    assert again.cache_files == first.cache_files

    changed = copy.deepcopy(smol_tokenizer)
    changed.chat_template = smol_tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")  # another template
    assert tokenizer_fingerprint(changed) != tokenizer_fingerprint(smol_tokenizer)
    retokenized = tokenize_dataset(raw, changed, data, "data.train")
    assert retokenized._fingerprint != first._fingerprint
    assert retokenized[0]["input_ids"] != first[0]["input_ids"]

    changed.add_tokens(["<new_token>"])  # another vocabulary
    assert tokenizer_fingerprint(changed) != tokenizer_fingerprint(smol_tokenizer)

    shorter = data.model_copy(update={"max_length": 40})
    assert tokenize_dataset(raw, smol_tokenizer, shorter, "data.train")._fingerprint != first._fingerprint


def test_a_recipe_chat_template_is_used_when_the_tokenizer_has_none(tmp_path, tiny_llama_dir, smol_tokenizer):
    import copy

    from hf_tune import load_recipe
    from hf_tune.model.loading import build_tokenizer

    bare = copy.deepcopy(smol_tokenizer)
    bare.chat_template = None
    data = DataSection(train={"path": str(write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}]))})
    raw, _ = load_raw_datasets(data, seed=0)
    with pytest.raises(HfTuneError, match="data.chat_template: the tokenizer has no chat template"):
        tokenize_dataset(raw, bare, data, "data.train")

    template = tmp_path / "chatml.jinja"
    template.write_text(smol_tokenizer.chat_template)
    recipe = load_recipe({"model": {"pretrained_model_name_or_path": tiny_llama_dir},
                          "data": {"train": {"path": str(tmp_path / "d.jsonl")}, "chat_template": str(template)}})
    tokenizer = build_tokenizer(recipe)
    assert tokenizer.chat_template == template.read_text()
    row = tokenize_example({"messages": CONVERSATION}, tokenizer, "chat", 1024)
    assert (row["input_ids"], row["labels"]) == chatml_reference(smol_tokenizer, CONVERSATION)


@pytest.mark.parametrize("training, seed", [({"seed": 42, "data_seed": 0}, 0), ({"seed": 7}, 7), ({}, 42)],
                         ids=["data_seed_0", "seed_only", "neither"])
def test_data_seed_is_training_data_seed_zero_included_else_seed(tmp_path, tiny_llama_dir, smol_tokenizer, training,
                                                                  seed):
    """As Trainer's samplers: ``data_seed`` when set (0 is a seed, not "unset"), else ``seed`` (default 42). The
    held-out eval examples are the ones datasets' own seeded split picks."""
    from datasets import Dataset

    from hf_tune import load_recipe
    from hf_tune.data import build_datasets, data_seed

    rows = [{"text": f"example number {i}"} for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    recipe = load_recipe({"model": {"pretrained_model_name_or_path": tiny_llama_dir},
                          "data": {"format": "text", "train": {"path": str(path)}, "eval_split": 0.25},
                          "training": {"output_dir": str(tmp_path / "run"), "report_to": "none", **training}})
    assert data_seed(recipe) == seed
    _, evaluation = build_datasets(recipe, smol_tokenizer)
    held_out = Dataset.from_list(rows).train_test_split(test_size=0.25, seed=seed)["test"]["text"]
    assert held_out != Dataset.from_list(rows).train_test_split(test_size=0.25, seed=seed + 1)["test"]["text"]
    assert evaluation["input_ids"] == [smol_tokenizer(t)["input_ids"] + [smol_tokenizer.eos_token_id] for t in held_out]


@pytest.mark.parametrize("name, format", [("chat_demo", "chat"), ("sharegpt_demo", "chat"),
                                          ("alpaca_demo", "instruction"), ("text_demo", "text"),
                                          ("topics_train", "classification")])
def test_every_shipped_example_file_fits_its_format(name, format):
    raw = load_source(DatasetSource(path=str(DATA / f"{name}.jsonl")), "data.train", format)
    rows = [json.loads(line) for line in (DATA / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    required = {"chat": ({"messages"}, {"conversations"}), "instruction": ({"instruction", "output"},),
                "text": ({"text"},), "classification": ({"text", "label"},)}[format]
    assert len(raw) == len(rows) > 0  # every line is an example
    assert all(any(columns <= row.keys() for columns in required) for row in rows)


def test_a_bad_example_is_named_by_its_line_even_after_blank_lines(tmp_path):
    good = {"messages": CONVERSATION[:2]}
    path = tmp_path / "d.jsonl"
    path.write_text(f"{json.dumps(good)}\n\n\n{json.dumps(good)}\n{json.dumps({'messages': [{'role': 'user'}]})}\n")
    with pytest.raises(HfTuneError, match=rf"data.eval: {path}, line 5 \(example 3 of 3\), column 'messages': turn 1 "
                                          r"has keys \['role'\], expected 'role' and 'content'"):
        load_source(DatasetSource(path=str(path)), "data.eval", "chat")


def test_chat_rows_may_mix_messages_and_sharegpt_conversations_but_need_one(tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION[:2]}, sharegpt])
    assert len(load_source(DatasetSource(path=str(path)), "data.train", "chat")) == 2
    path = write_jsonl(tmp_path / "e.jsonl", [{"messages": CONVERSATION[:2]}, sharegpt, {"messages": None}])
    with pytest.raises(HfTuneError, match="line 3 .*neither 'messages' nor 'conversations' is set"):
        load_source(DatasetSource(path=str(path)), "data.train", "chat")
