"""The format table: the schema reads exactly its names, and each format's normaliser is what its data goes through."""

from __future__ import annotations

import json
import typing

import pytest
from pydantic import ValidationError

from hf_tune.catalog.formats import DEFAULT_FORMAT, FORMATS
from hf_tune.catalog.methods import METHODS
from hf_tune.catalog.tasks import TASKS
from hf_tune.data.formats import check_columns
from hf_tune.data.preference import load_method_data
from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_example
from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import DataSection, DatasetSource

USER, ASSISTANT = "user", "assistant"


def message(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# a raw example of each format -> what it must read as: for sft, (messages or None for plain text, trained text);
# for the TRL methods, the row their trainer gets
SFT_EXAMPLES = {
    "chat": ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
             [message(USER, "Hi"), message(ASSISTANT, "Hello!")], "Hello!<|im_end|>"),
    "instruction": ({"instruction": "Add 2 and 3.", "input": "Show the sum.", "output": "5", "system": "Be brief."},
                    [message("system", "Be brief."), message(USER, "Add 2 and 3.\n\nShow the sum."),
                     message(ASSISTANT, "5")], "5<|im_end|>"),
    "prompt_completion": ({"prompt": [message(USER, "Hi"), message(ASSISTANT, "Hey"), message(USER, "Again?")],
                           "completion": "Sure."},
                          [message(USER, "Hi"), message(ASSISTANT, "Hey"), message(USER, "Again?"),
                           message(ASSISTANT, "Sure.")], "Sure.<|im_end|>"),
    "text": ({"text": "The sky is blue."}, None, "The sky is blue.<|im_end|>"),
}
TRL_EXAMPLES = {
    "preference": ({"instruction": "Say hi", "chosen": "Hi!", "rejected": "Go away."},
                   {"prompt": [message(USER, "Say hi")], "chosen": [message(ASSISTANT, "Hi!")],
                    "rejected": [message(ASSISTANT, "Go away.")]}),
    "unpaired_preference": ({"messages": [message(USER, "2+2?"), message(ASSISTANT, "4")], "label": True},
                            {"prompt": [message(USER, "2+2?")], "completion": [message(ASSISTANT, "4")],
                             "label": True}),
    "prompt_only": ({"prompt": [{"from": "human", "value": "What is 6*7?"}], "answer": "42"},
                    {"prompt": [message(USER, "What is 6*7?")], "answer": "42"}),
}


def test_the_schema_reads_exactly_the_tables_formats(tmp_path):
    assert typing.get_args(DataSection.model_fields["format"].annotation) == tuple(FORMATS)
    assert DataSection.model_fields["format"].default == DEFAULT_FORMAT
    source = DatasetSource(path="data.jsonl")
    assert [DataSection(train=source, format=name).format for name in FORMATS] == list(FORMATS)
    with pytest.raises(ValidationError, match="format"):
        DataSection(train=source, format="sharegpt")


def test_every_format_is_read_by_a_method_and_the_methods_and_tasks_name_only_table_formats():
    read = {name for method in METHODS.values() for name in method.formats}
    assert read == set(FORMATS)
    for method in METHODS.values():  # each method lists its formats once, its default first; unpaired ones among them
        assert len(set(method.formats)) == len(method.formats) and set(method.unpaired_formats) <= set(method.formats)
    assert METHODS["kto"].formats[0] == "unpaired_preference" and METHODS["kto"].unpaired_formats == ("preference",)
    assert {name for task in TASKS.values() for name in task.formats} <= set(FORMATS)


def test_every_formats_normaliser_is_covered_here():
    with_normaliser = {name for name, f in FORMATS.items() if f.normalizer}
    assert with_normaliser == set(SFT_EXAMPLES) | set(TRL_EXAMPLES) | {"vision_chat"}  # test_vision_chat.py
    assert all(f.class_labels for name, f in FORMATS.items() if name not in with_normaliser)  # tokenized as columns


@pytest.mark.parametrize("name", list(SFT_EXAMPLES))
def test_an_sft_example_is_tokenized_as_its_normalised_form(name, smol_tokenizer):
    raw, messages, trained = SFT_EXAMPLES[name]
    row = tokenize_example(raw, smol_tokenizer, name, 1024)
    if messages is None:  # plain text: the tokenizer's own encoding, then eos
        expected = smol_tokenizer(raw["text"])["input_ids"] + [smol_tokenizer.eos_token_id]
    else:  # the tokenizer's own chat template over the conversation the raw example means
        text = smol_tokenizer.apply_chat_template(messages, tokenize=False)
        expected = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == expected
    assert smol_tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX]) == trained


@pytest.mark.parametrize("name", list(TRL_EXAMPLES))
def test_a_trl_methods_example_is_loaded_as_its_normalised_form(name, tmp_path):
    raw, expected = TRL_EXAMPLES[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(raw) + "\n")
    method = next(m.name for m in METHODS.values() if name in m.formats and name not in m.unpaired_formats)
    train, _ = load_method_data(DataSection(train=DatasetSource(path=str(path)), format=name), method, 0)
    assert train.to_list() == [expected]


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_refuses_data_without_its_columns(name):
    layout = FORMATS[name].layouts[0]
    with pytest.raises(RecipeError, match=rf"format '{name}' needs .*'{layout[-1]}'") as refused:
        check_columns(name, list(layout[:-1]), "data.train", "data.jsonl")
    assert FORMATS[name].help in str(refused.value)
    check_columns(name, list(layout), "data.train", "data.jsonl")  # and reads it once they are there
