"""Checks of ``model.quantization_config`` (``transformers.BitsAndBytesConfig`` arguments, verbatim) and of the
combinations a quantized base cannot train in. A 4-bit base trains sharded (ZeRO-3, FSDP) as PEFT documents it:
``bnb_4bit_quant_storage`` equal to ``model.dtype``. Pure: reads the recipe (and the DeepSpeed JSON it names)."""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

from hf_tune.errors import RecipeError
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.upstream import did_you_mean
from hf_tune.runtime.ds_config import load_deepspeed_config

KEY = "model.quantization_config"
QUANT_TYPES = ("nf4", "fp4")
DTYPES = ("float32", "bfloat16", "float16")
# What BitsAndBytesConfig.to_dict() writes besides its arguments: accepted so a config.json's block can be pasted.
TO_DICT_KEYS = {"quant_method": "bitsandbytes", "_load_in_4bit": None, "_load_in_8bit": None}
QLORA_FIX = "pip install 'hf_tune[qlora]'"


def bitsandbytes_arguments() -> list[str]:
    from transformers import BitsAndBytesConfig

    return [name for name, p in inspect.signature(BitsAndBytesConfig.__init__).parameters.items()
            if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def quantized_bits(config: dict[str, Any] | None) -> int | None:
    """4 or 8 for a quantization_config that loads the base quantized, else None."""
    if not config:
        return None
    return 4 if config.get("load_in_4bit") else 8 if config.get("load_in_8bit") else None


def check_quantization(recipe: Recipe) -> None:
    config = recipe.model.quantization_config
    if config is None:
        return
    known = bitsandbytes_arguments()
    for key, value in config.items():
        if key in TO_DICT_KEYS:
            if TO_DICT_KEYS[key] is not None and value != TO_DICT_KEYS[key]:
                raise RecipeError(f"{KEY}.{key}", f"is {value!r}; hf_tune loads bitsandbytes quantization only",
                                  fix=f"remove it, or set it to {TO_DICT_KEYS[key]!r}")
            continue
        if key not in known:
            raise RecipeError(f"{KEY}.{key}", "unknown key: not an argument of transformers.BitsAndBytesConfig",
                              fix=did_you_mean(key, known))
    bits = quantized_bits(config)
    if config.get("load_in_4bit") and config.get("load_in_8bit"):
        raise RecipeError(f"{KEY}.load_in_4bit", f"and {KEY}.load_in_8bit are both true", fix="choose one of them")
    if bits is None:
        raise RecipeError(KEY, "quantizes nothing: neither load_in_4bit nor load_in_8bit is true",
                          fix=f"set {KEY}.load_in_4bit: true (QLoRA), or remove {KEY}")
    quant_type = config.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in QUANT_TYPES:
        raise RecipeError(f"{KEY}.bnb_4bit_quant_type", f"is {quant_type!r}",
                          fix=f"use one of {', '.join(QUANT_TYPES)}")
    for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage"):
        if config.get(key) is not None and str(config[key]).removeprefix("torch.") not in DTYPES + ("uint8",):
            raise RecipeError(f"{KEY}.{key}", f"is {config[key]!r}", fix=f"use one of {', '.join(DTYPES)}")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RecipeError(KEY, "needs the bitsandbytes package, which is not installed", fix=QLORA_FIX)
    _check_combinations(recipe, bits)


def _check_combinations(recipe: Recipe, bits: int) -> None:
    """What a quantized base cannot do, each refusal naming both keys."""
    flag = f"{KEY}.load_in_{bits}bit"
    if recipe.lora is None:
        raise RecipeError(flag, f"with no lora section is a full fine-tune of a {bits}-bit base: its quantized weights "
                          "have no gradients (Trainer refuses it after the model loads)",
                          fix="add a lora section (QLoRA: e.g. lora: {r: 16, target_modules: all-linear}), or remove "
                          f"{KEY} to fine-tune the full-precision model")
    sharded = weight_sharding(recipe)
    if sharded is None:
        return
    key, what = sharded
    if bits == 8:
        raise RecipeError(key, f"is {what} with {flag}: it partitions the weights, and an 8-bit base cannot be "
                          "partitioned (PEFT shards 4-bit bases only, through bnb_4bit_quant_storage)",
                          fix=f"set {KEY}: {{load_in_4bit: true, bnb_4bit_quant_storage: <model.dtype>}} (QLoRA "
                          f"sharded), or use ZeRO-2 (training.deepspeed: zero2) with the 8-bit base")
    storage = str(recipe.model.quantization_config.get("bnb_4bit_quant_storage") or "uint8").removeprefix("torch.")
    dtype = recipe.model.dtype
    if storage not in DTYPES or storage != dtype:
        target = dtype if dtype in DTYPES else "bfloat16"
        raise RecipeError(f"{KEY}.bnb_4bit_quant_storage", f"is {storage!r} and model.dtype is {dtype!r}, with {key} "
                          f"({what}): the 4-bit weights are sharded only when stored in the model's float dtype, "
                          "so that every parameter has one dtype (PEFT's ZeRO-3 / FSDP QLoRA)",
                          fix=f"set {KEY}.bnb_4bit_quant_storage to model.dtype (e.g. both {target}: "
                          f"model.dtype={target} {KEY}.bnb_4bit_quant_storage={target})")


def weight_sharding(recipe: Recipe) -> tuple[str, str] | None:
    """(key, what) when the recipe shards the weights over ranks: DeepSpeed ZeRO-3 or FSDP; else None."""
    deepspeed = recipe.training.get("deepspeed")
    if deepspeed:

        if (load_deepspeed_config(deepspeed).get("zero_optimization") or {}).get("stage") == 3:
            return "training.deepspeed", f"ZeRO-3 ({deepspeed!r})"
    fsdp = recipe.training.get("fsdp")
    if fsdp and "no_shard" not in str(fsdp):
        return "training.fsdp", f"FSDP ({fsdp!r})"
    return None
