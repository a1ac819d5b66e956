"""Writes the demo image set beside this file (deterministic; rerun to regenerate it), in datasets' imagefolder
layout: ``shapes/{train,test}/{red,green,blue}/N.png``, 32x32 pictures of one square, circle or triangle whose colour
is its class, at a random place and size on a light background (the ``image_classification`` format).

  shapes/train  12 pictures a class
  shapes/test    4 pictures a class
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).parent
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220)}


def draw_shape(rng: random.Random, colour: tuple[int, int, int], size: int = 32) -> Image.Image:
    """One shape of ``colour`` (each channel jittered) on a light background."""
    image = Image.new("RGB", (size, size), tuple(rng.randint(200, 255) for _ in range(3)))
    side = rng.randint(size // 3, size // 2)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    fill = tuple(max(0, min(255, c + rng.randint(-30, 30))) for c in colour)
    draw, shape = ImageDraw.Draw(image), rng.choice(("square", "circle", "triangle"))
    if shape == "square":
        draw.rectangle((x, y, x + side, y + side), fill=fill)
    elif shape == "circle":
        draw.ellipse((x, y, x + side, y + side), fill=fill)
    else:
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=fill)
    return image


def write_shapes(folder: Path, per_class: int, seed: int) -> None:
    rng = random.Random(seed)
    for name, colour in COLOURS.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            draw_shape(rng, colour).save(folder / name / f"{i}.png")


if __name__ == "__main__":
    write_shapes(HERE / "shapes" / "train", 12, seed=0)
    write_shapes(HERE / "shapes" / "test", 4, seed=1)
