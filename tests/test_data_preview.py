"""hf-tune data: the marked spans are the assistant turns, the counts equal ones made here from the template's own
renderings, every shipped recipe previews (or says why its data is not read), and training logs the same example."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from conftest import chat_recipe

from hf_tune import load_recipe, train
from hf_tune.commands.cli import main
from hf_tune.workflows.data_preview import data_preview

ROOT = Path(__file__).parent.parent
RECIPES = sorted(ROOT.joinpath("recipes").rglob("*.yaml"))
CHATS = [
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
     {"role": "assistant", "content": "5"}],
]


def chats_recipe(tmp_path: Path, model: str) -> dict:
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    raw = chat_recipe(model, tmp_path / "run")
    raw["data"]["train"]["path"] = str(data)
    return raw


def test_the_marked_spans_are_the_answers_and_the_counts_are_the_templates(tmp_path, tiny_llama_dir, smol_tokenizer):
    shown = data_preview(load_recipe(chats_recipe(tmp_path, tiny_llama_dir)), count=2)
    spans = re.findall(r"\[\[(.*?)\]\]", shown, flags=re.S)
    assert spans == ["Blue.<|im_end|>", "5<|im_end|>"]
    # independent counts: the whole chat and its prompt (up to the generation prompt), rendered by the template
    whole = [len(smol_tokenizer.apply_chat_template(chat, tokenize=True)["input_ids"]) for chat in CHATS]
    prompt = [len(smol_tokenizer.apply_chat_template(chat[:-1], tokenize=True, add_generation_prompt=True)
                  ["input_ids"]) for chat in CHATS]
    for total, asked in zip(whole, prompt):
        assert f"({total} tokens, {total - asked - 1} trained)" in shown  # the newline after <|im_end|> is not
    ignored = 1 - sum(total - asked - 1 for total, asked in zip(whole, prompt)) / sum(whole)
    assert f"tokens the loss ignores: {ignored:.1%}" in shown
    assert f"tokens per example: mean {sum(whole) / 2:.1f}, max {max(whole)}" in shown


@pytest.mark.parametrize("recipe", RECIPES, ids=[path.stem for path in RECIPES])
def test_every_shipped_recipe_previews(recipe, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "agent"))  # llm_agent's environment module
    main(["data", str(recipe), "--n", "1"])
    out = capsys.readouterr().out
    assert out.startswith("data not read: the tokenizer of ") or (
        "--- example 1 " in out and out.startswith("format: "))


def test_a_training_run_logs_its_first_example_marked(tmp_path, tiny_llama_dir, caplog):
    recipe = load_recipe(chats_recipe(tmp_path, tiny_llama_dir))
    with caplog.at_level(logging.INFO, logger="hf_tune"):
        train(recipe)
    logged = [record.getMessage() for record in caplog.records if "first training example" in record.getMessage()]
    assert len(logged) == 1 and ("[[Blue.<|im_end|>]]" in logged[0] or "[[5<|im_end|>]]" in logged[0])


def test_colour_marks_trained_tokens_in_a_terminal(tmp_path, tiny_llama_dir):
    shown = data_preview(load_recipe(chats_recipe(tmp_path, tiny_llama_dir)), count=1, colour=True)
    assert "\x1b[1;32m" in shown and "[[" not in shown
