"""Merge and push of vision runs: a LoRA image classifier (its head in modules_to_save, its classes named by the
data) and a LoRA VLM (the language model adapted, the tower frozen), merged, pushed to the stand-in Hub, loaded back
from the pushed files alone: the same logits as the trained model in memory, and a card that names the processor."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import REPO
from fake_hub import FakeHub
from inputs import TOKEN, front_matter
from PIL import Image
from vision_inputs import SHAPE_COLOURS as COLOURS
from vision_inputs import (
    draw,
    mllm_demo_rows,
    overrides,
    recipe_overrides,
    save_tiny,
    tiny_vlm,  # noqa: F401  (a fixture, requested by name)
    write_images,
)

from hf_tune import load_recipe, train
from hf_tune.workflows.hub import push
from hf_tune.workflows.merge_run import merge


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in Hub, and a fresh HF_HOME: what is loaded back comes from the pushed files, not a cache."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    with FakeHub() as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        yield fake


def pushed_folder(hub: FakeHub, folder):
    """The files of the stand-in Hub's last commit, written out as a repository clone would hold them."""
    for path, content in hub.commits[-1]["files"].items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(content)
    return folder


def logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**batch).logits


def changed_by_training(trained, batch) -> float:
    """How far the trained model's logits are from the same model with the adapter (and its saved head) turned off."""
    with torch.no_grad(), trained.disable_adapter():
        base = trained(**batch).logits
    return (logits(trained, batch) - base).abs().max().item()


def test_a_lora_image_classifier_merges_and_pushes_with_its_classes_and_processor(tmp_path, hub):
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    rng, shapes = random.Random(1), tmp_path / "shapes"
    for split in ("train", "test"):
        for name, colour in COLOURS.items():
            (shapes / split / name).mkdir(parents=True)
            for i in range(4):
                draw(rng, colour).save(shapes / split / name / f"{i}.png")
    run = tmp_path / "run"
    trainer = train(load_recipe(REPO / "recipes/image_classifier.yaml", overrides(
        save_tiny(tmp_path / "vit", "vit"), shapes, run, **{
            "training.max_steps": 3, "training.eval_strategy": "no", "lora.r": 4,
            "lora.target_modules": "[q_proj,v_proj]", "lora.modules_to_save": "[classifier]"})))
    assert json.loads((run / "class_labels.json").read_text())["id2label"] == {"0": "blue", "1": "green", "2": "red"}

    merge(run)
    push(run, "alice/tiny-vit", merged=True, token=TOKEN)
    files = hub.commits[-1]["files"]
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "README.md"} <= set(files)
    folder = pushed_folder(hub, tmp_path / "pushed")
    model = AutoModelForImageClassification.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    assert model.config.id2label == {0: "blue", 1: "green", 2: "red"}  # the folder names, sorted
    images = [Image.open(p).convert("RGB") for p in sorted((shapes / "test").rglob("*.png"))]
    batch = processor(images=images, return_tensors="pt")
    assert changed_by_training(trainer.model, batch) > 1e-3  # the adapter and the head have something to merge
    assert torch.allclose(logits(model, batch), logits(trainer.model, batch), atol=1e-5, rtol=0)

    meta, body = front_matter(files["README.md"]), files["README.md"].decode()
    assert meta["pipeline_tag"] == "image-classification" and meta["library_name"] == "transformers"
    assert "from transformers import AutoModelForImageClassification, AutoImageProcessor" in body
    assert "processor = AutoImageProcessor.from_pretrained('alice/tiny-vit')" in body and "AutoTokenizer" not in body

    push(run, "alice/tiny-vit-lora", base_model="google/vit-tiny", token=TOKEN)  # the adapter, with its classes
    files = hub.commits[-1]["files"]
    assert {"adapter_model.safetensors", "preprocessor_config.json", "class_labels.json"} <= set(files)
    body = files["README.md"].decode()
    snippet = ("AutoPeftModel.from_pretrained('alice/tiny-vit-lora', id2label={0: 'blue', 1: 'green', 2: 'red'}, "
               "ignore_mismatched_sizes=True)")
    assert snippet in body  # the base's own head has 2 classes: the card's call builds it with the trained 3


def test_a_lora_vlm_merges_and_pushes_with_its_processor_and_chat_template(tiny_vlm, tmp_path, hub):  # noqa: F811
    from transformers import AutoModelForImageTextToText, AutoProcessor

    paths = write_images(tmp_path / "images")
    (tmp_path / "train.json").write_text(json.dumps(mllm_demo_rows(paths, copies=2)))
    run = tmp_path / "run"
    trainer = train(load_recipe(REPO / "recipes/vlm_lora.yaml", recipe_overrides(
        tiny_vlm, tmp_path / "train.json", run, **{"training.max_steps": 3, "training.learning_rate": 1e-2})))

    push(run, "alice/tiny-vlm", merged=True, token=TOKEN)  # merged on the fly, in a temporary folder
    files = hub.commits[-1]["files"]
    assert {"model.safetensors", "config.json", "processor_config.json", "tokenizer.json",
            "chat_template.jinja"} <= set(files)  # processor_config.json holds the image processor's settings too
    folder = pushed_folder(hub, tmp_path / "pushed")
    model = AutoModelForImageTextToText.from_pretrained(folder)
    processor = AutoProcessor.from_pretrained(folder)
    prompt = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}], add_generation_prompt=True)
    assert prompt == AutoProcessor.from_pretrained(tiny_vlm).apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What colour is the square?"}]}], add_generation_prompt=True)
    images = [[Image.open(tmp_path / "images" / f"{colour}.png").convert("RGB")] for colour in ("red", "blue")]
    batch = processor(text=[prompt, prompt], images=images, return_tensors="pt")
    assert (batch["input_ids"] == processor.image_token_id).sum() == 2 * 4  # 4 image tokens an image
    assert changed_by_training(trainer.model, batch) > 1e-3
    assert torch.allclose(logits(model, batch), logits(trainer.model, batch), atol=1e-4, rtol=0)

    meta, body = front_matter(files["README.md"]), files["README.md"].decode()
    assert meta["pipeline_tag"] == "image-text-to-text"
    assert "from transformers import AutoModelForImageTextToText, AutoProcessor" in body
    assert "processor = AutoProcessor.from_pretrained('alice/tiny-vlm')" in body

    result = merge(run, tmp_path / "checked", check=True)  # base + adapter against the saved merge, drawn images
    assert result["streamed"]["merged_tensors"] == 2 * 7  # by shard: PEFT's names of the language model's weights
    assert result["relative_diff"] <= result["tolerance"]  # are the base checkpoint's
