"""data.chat_template by name: a base without a template trains with `chatml` (its answers, and only they, train);
TRL's shipped templates are names too; a mistyped name is refused with the closest; init writes a fitting name for a
base that has none."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import chat_recipe, save_tiny_llama

from hf_tune import load_recipe, train
from hf_tune.catalog.templates import fitting_templates, template_names
from hf_tune.errors import RecipeError
from hf_tune.workflows.data_preview import data_preview

CHATS = [[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
         [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"},
          {"role": "user", "content": "And 4 + 4?"}, {"role": "assistant", "content": "8"}]]


@pytest.fixture(scope="module")
def base_without_template(tmp_path_factory, smol_tokenizer) -> str:
    """A tiny Llama whose tokenizer has no chat template, as a base model's often has none."""
    import copy

    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = None
    folder = Path(save_tiny_llama(tmp_path_factory.mktemp("no-template"), tokenizer))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def recipe_of(tmp_path: Path, model: str, **data) -> dict:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    raw = chat_recipe(model, tmp_path / "run")
    raw["data"].update(train={"path": str(path)}, **data)
    return raw


def test_a_base_without_a_template_is_told_which_names_fit(base_without_template, tmp_path):
    with pytest.raises(RecipeError, match="data.chat_template: llama3_training or llama3 or chatml"):
        train(load_recipe(recipe_of(tmp_path, base_without_template)))


def test_chatml_trains_a_base_without_a_template_on_its_answers_only(base_without_template, tmp_path):
    recipe = load_recipe(recipe_of(tmp_path, base_without_template, chat_template="chatml"))
    shown = data_preview(recipe, count=2)
    assert re.findall(r"\[\[(.*?)\]\]", shown, flags=re.S) == ["Blue.<|im_end|>", "5<|im_end|>", "8<|im_end|>"]
    assert "<|im_start|>user\nAnd 4 + 4?<|im_end|>\n<|im_start|>assistant\n[[8" in shown
    trainer = train(recipe)
    assert trainer.state.global_step == 2
    saved = (tmp_path / "run" / "chat_template.jinja").read_text()
    assert saved == template_names()["chatml"].read_text()  # the run keeps the template it trained with


def test_trls_templates_are_names_and_a_typo_gets_the_closest(tmp_path, tiny_llama_dir):
    assert {"chatml", "qwen2_5_training", "llama3", "gemma3_training"} <= set(template_names())
    recipe = load_recipe(recipe_of(tmp_path, tiny_llama_dir, chat_template="qwen2_5_training"))
    assert "<|im_start|>system\nYou are Qwen" in data_preview(recipe, count=1)  # Qwen2.5's default system prompt
    with pytest.raises(RecipeError, match="did you mean 'qwen2_5_training'"):
        load_recipe(recipe_of(tmp_path, tiny_llama_dir, chat_template="qwen25_training"))


def test_fitting_names_put_the_familys_training_templates_first():
    assert fitting_templates("qwen3")[:2] == ["qwen3_5_nothink_training", "qwen3_5_think_training"]
    assert fitting_templates("llama")[0] == "llama3_training" and fitting_templates("mistral") == ["chatml"]


def test_init_names_a_template_for_a_base_without_one(base_without_template, offline, tmp_path):
    from hf_tune.workflows.init_recipe import write_recipe

    out = tmp_path / "recipe.yaml"
    write_recipe(base_without_template, out, gpus=1, gpu_memory_gb=24, data=str(tmp_path / "x.jsonl"))
    text = out.read_text()
    assert yaml.safe_load(text)["data"]["chat_template"] == "llama3_training"
    assert "# data.chat_template: llama3_training: the base's tokenizer has none; names that fit it:" in text
