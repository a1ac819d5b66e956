"""Images and vision models several test modules build: the drawn shapes and tiny ViT / ConvNeXt of the
image-classification tests, the tiny Idefics3 (SmolVLM's architecture), its squares and data layouts of the
vision-language tests. Kept here so that no test module imports another."""

from __future__ import annotations

import random

import pytest
from PIL import Image, ImageDraw

SHAPE_COLOURS = {  # the image-classification set: a shape of each
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220)}
LEARNING_RATE, DECAY, VIT_LAYERS = 3e-3, 0.5, 3


def draw(rng: random.Random, colour: tuple[int, int, int]) -> Image.Image:
    """A square, circle or triangle of ``colour`` (jittered) at a random place and size on a light background."""
    image = Image.new("RGB", (24, 24), tuple(rng.randint(200, 255) for _ in range(3)))
    side = rng.randint(8, 12)
    x, y = rng.randint(0, 24 - side), rng.randint(0, 24 - side)
    fill = tuple(max(0, min(255, c + rng.randint(-30, 30))) for c in colour)
    box, shape = (x, y, x + side, y + side), rng.choice(("square", "circle", "triangle"))
    draw_on = ImageDraw.Draw(image)
    if shape == "square":
        draw_on.rectangle(box, fill=fill)
    elif shape == "circle":
        draw_on.ellipse(box, fill=fill)
    else:
        draw_on.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=fill)
    return image


def save_tiny(folder, kind: str) -> str:
    """A random tiny ViT (3 blocks) or ConvNeXt (2 stages), with its (slow, PIL) image processor, at 16x16 pixels."""
    import torch
    from transformers import (
        ConvNextConfig,
        ConvNextForImageClassification,
        ConvNextImageProcessorPil,
        ViTConfig,
        ViTForImageClassification,
        ViTImageProcessorPil,
    )

    torch.manual_seed(0)
    if kind == "vit":
        config = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=VIT_LAYERS,
                           num_attention_heads=2, intermediate_size=64)
        ViTForImageClassification(config).save_pretrained(folder)
        ViTImageProcessorPil(size={"height": 16, "width": 16}).save_pretrained(folder)
    else:
        config = ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 2], num_stages=2, image_size=16)
        ConvNextForImageClassification(config).save_pretrained(folder)
        ConvNextImageProcessorPil(size={"shortest_edge": 16}).save_pretrained(folder)
    return str(folder)


def overrides(model: str, shapes, out, **more) -> list[str]:
    """The shipped recipe, on a tiny model and the drawn set."""
    values = {"model.pretrained_model_name_or_path": model, "data.train.data_dir": shapes,
              "data.eval.data_dir": shapes, "training.output_dir": out, "training.learning_rate": LEARNING_RATE,
              "optim.layerwise_lr_decay": DECAY, "training.disable_tqdm": "true", "training.save_strategy": "no",
              "training.load_best_model_at_end": "false", "training.logging_steps": 50,
              "model.ignore_mismatched_sizes": "true", **more}  # the tiny models have 2 classes, the drawn set 3
    return [f"{key}={value}" for key, value in values.items()]


# SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct)
TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]"
            "['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if "
            "line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
            "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
SQUARE_COLOURS = ("red", "green", "blue")  # the vision-language set: a square of each on white


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory, smol_tokenizer) -> str:
    """Idefics3: a 1-layer vision tower (32x32 pixels, 8x8 patches: 4 image tokens after pixel shuffle), a 2-layer
    Llama, SmolLM2's tokenizer with the image tokens added, SmolVLM's template; no image splitting."""
    import copy

    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, LlamaConfig
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    folder = tmp_path_factory.mktemp("tiny-vlm")
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32},
                                       max_image_size={"longest_edge": 32})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4,
                      chat_template=TEMPLATE).save_pretrained(folder)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id)
    config = Idefics3Config(vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                           "intermediate_size": 64, "image_size": 32, "patch_size": 8},
                            text_config=text.to_dict(), scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder)
    return str(folder)


def write_images(folder) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for colour in SQUARE_COLOURS:
        image = Image.new("RGB", (24, 24), "white")
        image.paste(Image.new("RGB", (12, 12), colour), (6, 6))
        image.save(folder / f"{colour}.png")
    return [f"images/{colour}.png" for colour in SQUARE_COLOURS]


def trl_rows(paths: list[str]) -> list[dict]:
    """TRL's layout: image parts in the content, the images beside; the last row has two turns."""
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"},
                                                       {"type": "text", "text": "What colour is the square?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": colour}]}],
             "images": [path]} for colour, path in zip(SQUARE_COLOURS, paths)]
    rows[-1]["messages"] += [{"role": "user", "content": [{"type": "text", "text": "Sure?"}]},
                             {"role": "assistant", "content": [{"type": "text", "text": "Yes, blue."}]}]
    return rows


def mllm_demo_rows(paths: list[str], copies: int = 4) -> list[dict]:
    """LLaMA-Factory's mllm_demo layout: string content with <image> markers, and an images list."""
    return [{"messages": [{"role": "user", "content": "<image>What colour is the square?"},
                          {"role": "assistant", "content": colour}], "images": [path]}
            for _ in range(copies) for colour, path in zip(SQUARE_COLOURS, paths)]


def recipe_overrides(model: str, data, out, **more) -> list[str]:
    values = {"model.pretrained_model_name_or_path": model, "data.train.path": data, "training.output_dir": out,
              "data.eval_split": "null", "training.eval_strategy": "no", "training.save_strategy": "no",
              "training.disable_tqdm": "true", "training.per_device_train_batch_size": 3,
              "training.gradient_accumulation_steps": 1, "training.learning_rate": 1e-3, "training.logging_steps": 1,
              **more}
    return [f"{key}={value}" for key, value in values.items()]


