"""``hf-tune plan`` of vision-language data: tokens per example include the image tokens the processor expands each
image into, and the activation estimate reads micro-batches of that width."""

from __future__ import annotations

import json

from conftest import REPO
from PIL import Image
from vision_inputs import recipe_overrides, tiny_vlm, trl_rows, write_images  # noqa: F401  (tiny_vlm: a fixture)

from hf_tune import load_recipe


def test_plan_counts_each_images_tokens_as_the_processor_expands_them(tiny_vlm, tmp_path):  # noqa: F811
    from transformers import AutoConfig, AutoProcessor

    from hf_tune.commands.plan import format_plan
    from hf_tune.model.memory import activation_memory
    from hf_tune.workflows.plan import plan

    paths = write_images(tmp_path / "images")
    rows = trl_rows(paths)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = load_recipe(REPO / "recipes/vlm_lora.yaml", recipe_overrides(tiny_vlm, tmp_path / "train.jsonl",
                                                                          tmp_path / "run"))
    result = plan(recipe, out_dir=tmp_path / "plan")

    processor = AutoProcessor.from_pretrained(tiny_vlm)  # the count, independently: the processor on each example
    counted = []
    for row in rows:
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        images = [[Image.open(tmp_path / path).convert("RGB") for path in row["images"]]]
        counted.append(processor(text=[text], images=images, add_special_tokens=False)["input_ids"][0])
    image_tokens = [list(ids).count(processor.image_token_id) for ids in counted]
    assert image_tokens == [processor.image_seq_len] * len(rows)  # one 32x32 image, no splitting: image_seq_len (4)
    tokens = result["tokens_per_example"]
    assert tokens["max"] == max(map(len, counted)) and tokens["image_tokens_mean"] == processor.image_seq_len
    assert tokens["mean"] == sum(map(len, counted)) / len(rows)
    width = 3 * max(map(len, counted))  # per_device_train_batch_size 3, padded to the longest example
    assert result["activations"]["tokens"] == width
    config = AutoConfig.from_pretrained(tiny_vlm)  # the language model's activations, for that width
    assert result["activations"]["bytes"] == activation_memory(config.text_config, width, False, lora_r=16) > 0
    assert f"max {tokens['max']} (image tokens: 4.0 on average)" in format_plan(result)
