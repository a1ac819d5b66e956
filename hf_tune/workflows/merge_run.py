"""Merging a LoRA run into its base (``hf-tune merge``): by shard where the base's safetensors can be streamed,
else through PEFT (``merge_and_unload``); a QLoRA run dequantized first; ``check`` compares the merged model's logits
with base + adapter."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hf_tune import run_folder
from hf_tune.catalog.tasks import Task, task_of
from hf_tune.errors import HfTuneError
from hf_tune.model.merge import (
    CannotStream,
    base_checkpoint_folder,
    plan_shard_merge,
    read_lora_deltas,
)
from hf_tune.model.merge_write import write_merged_shards
from hf_tune.model.quantization import bitsandbytes_config, dequantize, keep_weight_layout
from hf_tune.records.model_card import run_class_labels
from hf_tune.records.run_reader import load_adapter_run, open_run

logger = logging.getLogger(__name__)

MERGE_CHECK_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}  # max |Δ logit| / max |logit|
QUANTIZED_DTYPES = ("nf4", "fp4", "int4", "int8", "4bit", "8bit")  # --dtype values a QLoRA run's merge refuses


def run_task(run_dir: Path) -> Task:
    """The task of the run's recipe (its model section's ``task``; the default task when unset)."""
    return task_of(recipe_model(run_dir).get("task"))


def merge(run_dir: str | Path, out: str | Path | None = None, dtype: str = "float32", check: bool = False) -> dict:
    """Merge a run's LoRA adapter into its base model and save safetensors + the task's processor (tokenizer and chat
    template, image processor, a VLM's processor) to ``out`` (default RUN_DIR/merged). ``check`` compares the saved
    model's logits with base + adapter on the task's sample inputs (``Task.check_inputs``)."""
    import shutil

    run_dir = open_run(run_dir, needs=("adapter", "tokenizer")).path
    quantization = _run_quantization(run_dir)
    if dtype not in MERGE_CHECK_TOLERANCE:
        if quantization and dtype.lower() in QUANTIZED_DTYPES:
            raise HfTuneError(f"--dtype {dtype} with the run's model.quantization_config: merging into quantized "
                              "weights re-quantizes base + update, which rounds most of the adapter's update away\n"
                              "  fix: merge to float32, bfloat16 or float16 (the base is dequantized first); to serve "
                              "it quantized, load the merged model with the same quantization_config")
        raise HfTuneError(f"--dtype: {dtype!r} is not one of {sorted(MERGE_CHECK_TOLERANCE)}")
    final = Path(out) if out else run_dir / run_folder.MERGED
    if final.exists() and not (final / run_folder.MODEL_CONFIG).is_file():
        raise HfTuneError(f"--out {final}: exists and is not a merged model (no config.json)\n  fix: choose a new "
                          "folder, or remove it")
    out = final.with_name(f".{final.name}.partial")  # written aside, renamed once whole: a failure leaves nothing
    shutil.rmtree(out, ignore_errors=True)
    try:
        result = _merge_into(run_dir, out, dtype, check, quantization)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)  # an earlier merge: replaced whole
    os.replace(out, final)
    return {**result, "merged_dir": str(final)}


def _merge_into(run_dir: Path, out: Path, dtype: str, check: bool, quantization: dict | None) -> dict:
    """The merge, written to ``out``: the merged weights, the processor, the recipe and results, the check."""
    import shutil

    import torch

    task = run_task(run_dir)
    processor = task.processor_class.from_pretrained(run_dir)  # saved beside the adapter by Trainer
    samples = task.build_check_inputs(processor, task)
    tolerance = MERGE_CHECK_TOLERANCE[dtype]
    result = {"merged_dir": str(out), "dtype": dtype}
    plan = None if quantization else _shard_plan(run_dir, task, _vocabulary_size(processor, task))
    if plan is not None:  # the reference first, freed before the merge: one model in memory at a time
        reference = _reference_logits(run_dir, task, samples) if check else None
        result["streamed"] = write_merged_shards(plan, out, dtype)
    else:
        if quantization:
            reference, merged, compute_tolerance = _merge_quantized(run_dir, task, quantization, samples, check)
            tolerance = max(tolerance, compute_tolerance)
        else:
            reference, merged = _merge_with_peft(run_dir, task, samples, check)
        merged.to(getattr(torch, dtype)).save_pretrained(out)
        del merged
    processor.save_pretrained(out)
    for name in (run_folder.RECIPE, *run_folder.RESULTS):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, out / name)
    if check:
        result.update(_check_merged(out, task, samples, reference, dtype, tolerance))
    if quantization:
        result["dequantized_from"] = quantization
    return result


def recipe_model(run_dir: Path) -> dict:
    """The run's recipe ``model`` section ({} for a folder without recipe.yaml)."""
    return open_run(run_dir).recipe(required=False).get("model") or {}


def _run_quantization(run_dir: Path) -> dict | None:
    return recipe_model(run_dir).get("quantization_config") or None


def _shard_plan(run_dir: Path, task: Task, vocab_size: int | None):
    """The merge by shard's plan (hf_tune.model.merge), or None, with the reason logged, where PEFT's whole-model
    merge must run instead: another task, a GGUF or .bin base, a LoRA variant (DoRA, modules_to_save, ...)."""
    model = recipe_model(run_dir)
    run = open_run(run_dir)
    adapter = run.adapter_config()
    base, revision = run.adapter_base()
    revision = model.get("revision") or revision
    try:
        if not task.merges_by_shard:
            raise CannotStream(f"model.task {task.name}: its head is built by PEFT")
        if model.get("gguf_file"):
            raise CannotStream(f"model.gguf_file {model['gguf_file']}: the base is a GGUF file, not safetensors")
        deltas = read_lora_deltas(run_dir)
        folder = base_checkpoint_folder(base, revision, model.get("subfolder"), model.get("cache_dir"))
        return plan_shard_merge(folder, deltas, task.model_class, bool(model.get("trust_remote_code")), vocab_size,
                                adapter)
    except CannotStream as reason:
        logger.warning("Merging through PEFT, which loads base + adapter whole in float32: %s", reason)
        return None


def _vocabulary_size(processor, task: Task) -> int | None:
    """Tokens of the run's tokenizer (a VLM's processor holds one); None for an image processor."""
    tokenizer = processor if task.reads_text else getattr(processor, "tokenizer", None)
    return len(tokenizer) if tokenizer is not None else None


def _peft_model(run_dir: Path, task: Task):
    import torch

    head = {"num_labels": task.num_labels} if task.num_labels else {}  # a reward model's one score
    labels = run_class_labels(run_dir) if task.class_labels else None
    if labels:  # the trained head's classes: the base's own head may have another width
        head.update(id2label=labels, label2id={name: i for i, name in labels.items()}, ignore_mismatched_sizes=True)
    return load_adapter_run(open_run(run_dir), task.model_class, dtype=torch.float32, **head).eval()


def _reference_logits(run_dir: Path, task: Task, samples):
    """Logits of base + adapter (float32) on the sample inputs; the model is freed on return."""
    import torch

    with torch.no_grad():
        return _peft_model(run_dir, task)(**samples).logits


def _merge_with_peft(run_dir: Path, task: Task, samples, check: bool):
    """(reference logits or None, merged model): PEFT's merge_and_unload of the whole model in float32."""
    import torch

    model = _peft_model(run_dir, task)
    with torch.no_grad():
        reference = model(**samples).logits if check else None
    return reference, model.merge_and_unload()


def _check_merged(out: Path, task: Task, samples, reference, dtype: str, tolerance: float) -> dict:
    """Compare the saved model's logits (reloaded in float32) with the reference; fail beyond the tolerance."""
    import torch

    reloaded = task.model_class.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (reloaded(**samples).logits - reference).abs().max().item()
    relative = diff / max(reference.abs().max().item(), 1e-12)
    if relative > tolerance:
        raise HfTuneError(f"merge check failed: max |Δ logit| = {diff:.3g} ({relative:.2e} of the largest logit) "
                          f"exceeds the {dtype} tolerance {tolerance:g}")
    return {"max_abs_logit_diff": diff, "relative_diff": relative, "tolerance": tolerance}


def _merge_quantized(run_dir: Path, task: Task, quantization: dict, samples, check: bool):
    """(reference logits or None, merged model, the tolerance of the quantized compute) for a QLoRA run: the
    reference is the quantized base + adapter as trained; the merge dequantizes a second copy of the base to float32
    first and merges the adapter into those plain weights (PEFT's merge into a 4-bit layer would re-quantize the
    sum). A 4-bit layer computes in bnb_4bit_compute_dtype; an 8-bit one quantizes its inputs to int8 as well
    (LLM.int8), held to the bfloat16 tolerance (benchmarks/RESULTS.md)."""
    import torch
    from peft import PeftModel

    base_path, _ = open_run(run_dir).adapter_base()
    config = bitsandbytes_config(quantization)
    compute = str(config.bnb_4bit_compute_dtype or torch.float32).removeprefix("torch.") \
        if config.load_in_4bit else "bfloat16"

    def quantized_base():
        base = task.model_class.from_pretrained(base_path, quantization_config=config, dtype=torch.float32)
        keep_weight_layout(base)
        return base

    reference = None
    if check:
        trained = PeftModel.from_pretrained(quantized_base(), run_dir).eval()
        with torch.no_grad():
            reference = trained(**samples).logits.float()
        del trained
    plain = dequantize(quantized_base(), torch.float32)
    merged = PeftModel.from_pretrained(plain, run_dir).eval().merge_and_unload()
    return reference, merged, MERGE_CHECK_TOLERANCE[compute]
