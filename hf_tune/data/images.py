"""Image classification data: image columns read as images (paths relative to the data file's folder), every image
opened and decoded before training so a missing file, unreadable bytes or an unusable mode is named by file and row,
class ids from the training data's names, and the collator that runs the model's image processor on each batch.

The images stay in the dataset (Arrow holds the file's path or bytes) and are turned into pixels batch by batch, by
the processor the model ships (``AutoImageProcessor``: its resize, rescale and normalisation), so nothing the size of
the pixel tensors is cached on disk.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import PIL.Image
from datasets import ClassLabel, Dataset, Features, Image, List, Value

from hf_tune.data.formats import check_columns, format_of
from hf_tune.errors import RecipeError, describe_exception, stage_errors
from hf_tune.recipe.schema import DataSection

# Modes whose values do not fit 8 bits: converting them to RGB clips them, so they are refused (convert the files).
HIGH_DEPTH_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N", "F"}
_DRAFT_SIZE = (64, 64)  # JPEGs decode at a reduced scale for the check: every byte is still read


IMAGE_KINDS = ("image", "images")  # Column kinds: one image a row, a list of images a row


def image_columns(format: str) -> list[tuple[str, str]]:
    """(column, kind) of the columns of ``format`` that hold images."""
    return [(column.name, column.kind) for column in format_of(format).columns if column.kind in IMAGE_KINDS]


def as_images(dataset: Dataset, format: str, base: Path | None) -> Dataset:
    """Each image column of ``format`` as datasets ``Image`` features (a list of them for kind ``images``): file
    paths are cast, a relative path read from ``base`` (the data file's folder), as imagefolder's metadata files read
    theirs."""
    for column, kind in image_columns(format):
        if column not in dataset.column_names or _is_images(dataset.features[column], kind):
            continue
        if base is not None and _holds_strings(dataset.features[column], kind):
            relocate = (lambda p: _under(base, p)) if kind == "image" else (
                lambda ps: None if ps is None else [_under(base, p) for p in ps])
            dataset = dataset.map(lambda values: {column: [relocate(v) for v in values]}, batched=True,
                                  input_columns=[column], desc=f"Locating the images of {column!r}")
        try:
            dataset = dataset.cast_column(column, Image() if kind == "image" else List(Image()))
        except (TypeError, ValueError):
            pass  # a column of another type: check_images names the first row that is not an image
    return dataset


def _is_images(feature, kind: str) -> bool:
    return isinstance(feature, Image) if kind == "image" else isinstance(feature, List) and isinstance(
        feature.feature, Image)


def _holds_strings(feature, kind: str) -> bool:
    if kind == "images":
        feature = feature.feature if isinstance(feature, List) else None
    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def _under(base: Path, path: str | None) -> str | None:
    return path if path is None or Path(path).is_absolute() else str(base / path)


def check_images(dataset: Dataset, column: str, refuse: Callable[[int, str, str], Any], kind: str = "image") -> None:
    """Open and decode every image of ``column``; ``refuse(row, column, problem)`` for the first that fails."""
    if not _is_images(dataset.features[column], kind):
        refuse(0, column, f"expected {'an image' if kind == 'image' else 'a list of images'} (file paths or image "
                          f"features), got a {dataset.features[column]}")
    undecoded = Image(decode=False) if kind == "image" else List(Image(decode=False))
    for row, value in enumerate(dataset.cast_column(column, undecoded)[column]):
        for number, one in enumerate([value] if kind == "image" else value or []):
            problem = image_problem(one)
            if problem:
                refuse(row, column, problem if kind == "image" else f"image {number + 1}: {problem}")


def image_problem(value: dict[str, Any] | None) -> str | None:
    """What keeps one image (datasets' ``{"path", "bytes"}``) from training, naming its file; None when it decodes."""
    if value is None:
        return "is missing (null)"
    path, data = value.get("path"), value.get("bytes")
    name = f"image file {path}" if path else "the image bytes"
    if data is None:
        if not path or not Path(path).is_file():
            return f"no such image file: {path}"
    try:
        with PIL.Image.open(io.BytesIO(data) if data is not None else path) as image:
            mode = image.mode
            image.draft(mode, _DRAFT_SIZE)
            image.load()
    except Exception as err:  # PIL raises many types for bad bytes (UnidentifiedImageError, OSError, SyntaxError)
        return f"{name} is not a readable image: {describe_exception(err)}"
    if mode in HIGH_DEPTH_MODES:
        return (f"{name} has mode {mode!r} (more than 8 bits a value), which cannot become RGB without clipping; "
                "save it as 8-bit (PIL: image.convert('RGB'))")
    return None


def image_examples(raw: Dataset, processor, data: DataSection, labels: list[str], key: str) -> Dataset:
    """``image`` + ``label`` -> ``pixel_values`` (still the images: the collator runs the processor) + ``labels``
    (ids in the order of ``labels``, the training data's class names). The names match the model's forward, so
    Trainer keeps both columns."""
    check_columns(data.format, raw.column_names, key)
    raw = raw.select_columns(["image", "label"])
    feature = raw.features["label"]
    if isinstance(feature, ClassLabel) and feature.names != labels:  # another split's folders: ids by name
        raw = raw.map(lambda ids: {"label": [feature.int2str(i) for i in ids]}, batched=True, input_columns=["label"],
                      features=Features({**raw.features, "label": Value("string")}))
        feature = raw.features["label"]
    if not isinstance(feature, ClassLabel):
        unknown = sorted({str(v) for v in raw.unique("label")} - set(labels))
        if unknown:
            raise RecipeError(key, f"labels {unknown[:5]} do not occur in data.train (classes: {labels[:10]})",
                              fix="every eval label must be one of the training labels")
        with stage_errors(key, "reading the class labels"):
            if feature.dtype not in ("string", "large_string"):
                raw = raw.cast_column("label", Value("string"))
            raw = raw.cast_column("label", ClassLabel(names=labels))
    return raw.rename_columns({"image": "pixel_values", "label": "labels"})


class ImageClassificationCollator:
    """A batch of images through the model's image processor (resize, rescale, normalise as it is configured), in
    the mode its normalisation expects: RGB for three channel means, L for one."""

    def __init__(self, processor):
        self.processor = processor
        mean = getattr(processor, "image_mean", None)
        self.mode = "L" if isinstance(mean, (list, tuple)) and len(mean) == 1 else "RGB"

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        images = [f["pixel_values"] if f["pixel_values"].mode == self.mode else f["pixel_values"].convert(self.mode)
                  for f in features]
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels, "labels": torch.tensor([f["labels"] for f in features], dtype=torch.long)}


def drawn_images(count: int = 2, size: int = 48) -> list[PIL.Image.Image]:
    """``count`` RGB images of seeded noise over a colour gradient: inputs that every image processor accepts."""
    import numpy as np

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, size)
    images = []
    for i in range(count):
        channels = [np.add.outer(ramp, ramp) / 2, np.tile(ramp, (size, 1)).T, np.full((size, size), 80.0 * i)]
        pixels = np.stack(channels, -1)
        pixels = np.clip(pixels + rng.normal(0, 40, pixels.shape), 0, 255).astype(np.uint8)
        images.append(PIL.Image.fromarray(pixels, "RGB"))
    return images


def sample_images(processor, task) -> dict:
    """Two drawn images through the run's image processor: the inputs of ``hf-tune merge --check``."""
    return dict(processor(images=drawn_images(), return_tensors="pt"))
