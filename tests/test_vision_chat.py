"""Vision-language SFT: a tiny random Idefics3 (SmolVLM's architecture) with a processor around the embedded
SmolLM2 tokenizer; assistant-only labels against an independent mask, TRL's and LLaMA-Factory's layouts, LoRA on
the language model with the vision tower frozen, a real Trainer run, the shipped recipe."""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from PIL import Image
from vision_inputs import SQUARE_COLOURS as COLOURS
from vision_inputs import (
    mllm_demo_rows,
    recipe_overrides,
    tiny_vlm,  # noqa: F401  (a fixture, requested by name)
    trl_rows,
    write_images,
)

from hf_tune import load_recipe, train
from hf_tune.errors import RecipeError


def independent_labels(tokenizer, ids: list[int]) -> list[int]:
    """-100 everywhere but each assistant answer: the tokens after each 'Assistant:' up to and including the
    '<end_of_utterance>' and newline that close it (found in the ids, without the template or the code's spans)."""
    opener = tokenizer("\nAssistant:", add_special_tokens=False)["input_ids"][1:]  # 'Ass', 'istant', ':'
    closer = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    labels, i = [-100] * len(ids), 0
    while i < len(ids):
        if ids[i: i + len(opener)] == opener:
            start = i + len(opener)
            end = ids.index(closer, start) + 2  # the closing marker and its newline
            labels[start:end] = ids[start:end]
            i = end
        else:
            i += 1
    return labels


def as_value_parts(row: dict) -> dict:
    """LLaMA-Factory's spelling of a text part: its text under 'value' (TRL's and OpenAI's: 'text')."""
    return {**row, "messages": [{**m, "content": [{"type": "text", "value": p["text"]} if p["type"] == "text" else p
                                                  for p in m["content"]]} for m in row["messages"]]}


@pytest.mark.parametrize("text_key", ["text", "value"])
def test_labels_are_the_assistant_tokens_only_in_trl_layout(tiny_vlm, tmp_path, text_key):
    from transformers import AutoProcessor

    from hf_tune.data import build_training_data
    from hf_tune.training_args import build_training_arguments

    paths = write_images(tmp_path / "images")
    data = tmp_path / "train.jsonl"
    rows = [row if text_key == "text" else as_value_parts(row) for row in trl_rows(paths)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = load_recipe(REPO / "recipes/vlm_lora.yaml", recipe_overrides(tiny_vlm, data, tmp_path / "run"))
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    examples = build_training_data(recipe, processor, build_training_arguments(recipe)).train
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    for example in examples:
        assert example["labels"] == independent_labels(processor.tokenizer, example["input_ids"])
        assert example["input_ids"].count(image_id) == 4  # the processor's image tokens, none trained
    trained = [processor.tokenizer.decode([t for t in ex["labels"] if t != -100]) for ex in examples]
    assert trained == [" red<end_of_utterance>\n", " green<end_of_utterance>\n",
                       " blue<end_of_utterance>\n Yes, blue.<end_of_utterance>\n"]


def test_a_row_whose_markers_and_images_disagree_is_refused_by_row(tiny_vlm, tmp_path):
    from transformers import AutoProcessor

    from hf_tune.data import build_training_data
    from hf_tune.training_args import build_training_arguments

    paths = write_images(tmp_path / "images")
    rows = mllm_demo_rows(paths, copies=1)
    rows[1]["images"] = paths[:2]
    data = tmp_path / "train.json"
    data.write_text(json.dumps(rows))
    recipe = load_recipe(REPO / "recipes/vlm_lora.yaml", recipe_overrides(tiny_vlm, data, tmp_path / "run"))
    with pytest.raises(RecipeError, match=r"example 2 of 3, column 'messages': 1 image places .* but 2 images"):
        build_training_data(recipe, AutoProcessor.from_pretrained(tiny_vlm), build_training_arguments(recipe))


@pytest.mark.slow
def test_the_shipped_recipe_trains_lora_on_the_language_model_in_mllm_demo_layout(tiny_vlm, tmp_path):
    import torch

    paths = write_images(tmp_path / "images")
    data = tmp_path / "mllm_demo.json"
    data.write_text(json.dumps(mllm_demo_rows(paths)))
    trainer = train(load_recipe(REPO / "recipes/vlm_lora.yaml",
                                recipe_overrides(tiny_vlm, data, tmp_path / "run", **{"training.max_steps": 4})))
    assert trainer.state.global_step == 4
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    adapted = {name.split(".lora_")[0] for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapted and all(".text_model." in name for name in adapted)  # no adapter on the vision tower
    assert not any("vision_model" in n or "connector" in n for n, p in trainer.model.named_parameters()
                   if p.requires_grad)
    saved = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert saved["exclude_modules"] and (tmp_path / "run" / "processor_config.json").is_file()


def test_the_shipped_recipe_validates_and_plans_offline(tmp_path, monkeypatch):
    from hf_tune.workflows.plan import plan

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for module in ("hf_tune.runtime.network", "hf_tune.assembly.preflight", "hf_tune.model.loading"):
        monkeypatch.setattr(f"{module}.hub_is_reachable", lambda *a, **k: False)
    result = plan(load_recipe(REPO / "recipes/vlm_lora.yaml", [f"training.output_dir={tmp_path}"]), out_dir=tmp_path)
    assert "not at hand" in result["data_not_read"]  # the processor tokenizes: without it the data is not counted
    # LoRA r=16 on the 30 language-model blocks' 7 projections (SmolVLM-256M's shipped config), none on the tower
    h, f, q, kv, r = 576, 1536, 576, 3 * 64, 16
    per_block = r * ((h + q) + (h + kv) * 2 + (q + h) + 2 * (h + f) + (f + h))
    assert result["trainable_params"] == 30 * per_block



@pytest.mark.slow
def test_a_tiny_vlm_learns_what_colour_the_square_is(tiny_vlm, tmp_path):
    """Full fine-tune, tower included, 60 steps on one square a colour: the same question gets each square's colour
    (the image is all that differs between the prompts; chance of three right answers: 1/27). Squares at new places
    are not asked: this tiny model, so trained, answered 8 of 12 of them (red and blue right, green as red)."""
    import dataclasses

    import torch
    from transformers import AutoProcessor

    paths = write_images(tmp_path / "images")
    (tmp_path / "train.json").write_text(json.dumps(mllm_demo_rows(paths, copies=8)))
    recipe = load_recipe(REPO / "recipes/vlm_lora.yaml", recipe_overrides(
        tiny_vlm, tmp_path / "train.json", tmp_path / "run", **{
            "training.max_steps": 60, "training.learning_rate": 1e-2, "training.per_device_train_batch_size": 6,
            "training.logging_steps": 10, "model.train_vision_tower": "true"}))
    model = train(dataclasses.replace(recipe, lora=None)).model.eval()
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}], add_generation_prompt=True)
    answers = []
    for colour in COLOURS:
        batch = processor(text=[prompt], images=[[Image.open(tmp_path / "images" / f"{colour}.png").convert("RGB")]],
                          return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=2, do_sample=False)
        answers.append(processor.tokenizer.decode(out[0, batch["input_ids"].shape[1]:]).split("<")[0].strip())
    assert answers == list(COLOURS), answers
