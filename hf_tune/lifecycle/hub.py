"""The Hugging Face Hub: merging a LoRA run, and pushing a run with its model card."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from huggingface_hub import constants  # noqa: F401  (tests and users patch hf_tune.lifecycle.hub.constants)

from hf_tune.catalog.tasks import Task, task_of
from hf_tune.catalog.trackers import tracker_files
from hf_tune.errors import HfTuneError
from hf_tune.lifecycle import run_folder
from hf_tune.lifecycle.model_card import base_model_id, render_model_card, run_class_labels
from hf_tune.lifecycle.run_reader import load_adapter_run, open_run
from hf_tune.model.merge import (
    CannotStream,
    base_checkpoint_folder,
    plan_shard_merge,
    read_lora_deltas,
    write_merged_shards,
)
from hf_tune.model.quantization import bitsandbytes_config, dequantize, keep_weight_layout
from hf_tune.runtime.network import hub_is_reachable  # noqa: F401  (hf_tune.lifecycle.hub.hub_is_reachable, as before)

logger = logging.getLogger(__name__)


# What a push uploads, by name: an allow-list, so that a file that Trainer or a tracker adds to the run folder stays
# private until it is named here. Weights and tokenizer come from the run folder (or RUN_DIR/merged), the rest from
# the run folder; README.md and adapter_config.json are written for the upload, never into the run folder.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_config.json", "config.json", "generation_config.json",
                "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "additional_chat_templates/*.jinja",
                   "preprocessor_config.json", "processor_config.json")  # an image processor, a VLM's processor
RESULT_FILES = (run_folder.RECIPE, run_folder.TRAIN_RESULTS, run_folder.EVAL_RESULTS, run_folder.ALL_RESULTS,
                run_folder.CLASS_LABELS)
# only with include_manifest: host, command line, env
MANIFEST_FILES = (run_folder.MANIFEST, run_folder.TRAINER_STATE, "*.png")
TRACKER_LOGS = tracker_files("logs")  # only with include_logs: each tracker's folder (hf_tune.catalog.trackers)
MERGE_CHECK_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}  # max |Δ logit| / max |logit|
QUANTIZED_DTYPES = ("nf4", "fp4", "int4", "int8", "4bit", "8bit")  # --dtype values a QLoRA run's merge refuses


def run_task(run_dir: Path) -> Task:
    """The task of the run's recipe (its model section's ``task``; the default task when unset)."""
    return task_of(_recipe_model(run_dir).get("task"))


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


def _recipe_model(run_dir: Path) -> dict:
    """The run's recipe ``model`` section ({} for a folder without recipe.yaml)."""
    return open_run(run_dir).recipe(required=False).get("model") or {}


def _run_quantization(run_dir: Path) -> dict | None:
    return _recipe_model(run_dir).get("quantization_config") or None


def _shard_plan(run_dir: Path, task: Task, vocab_size: int | None):
    """The merge by shard's plan (hf_tune.model.merge), or None, with the reason logged, where PEFT's whole-model
    merge must run instead: another task, a GGUF or .bin base, a LoRA variant (DoRA, modules_to_save, ...)."""
    model = _recipe_model(run_dir)
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


def push(run_dir: str | Path, repo_id: str, merged: bool = False, private: bool = False,
         revision: str | None = None, token: str | None = None, base_model: str | None = None,
         include_manifest: bool = False, include_logs: bool = False) -> str:
    """Create the repo if needed and upload what a model repo needs (see ``upload_plan``): the adapter (or, with
    ``merged``, the merged model), tokenizer, a README.md model card, the redacted recipe and the results. The uploaded
    adapter_config.json names the base by its Hub id (``base_model`` for a run trained on a local folder). The run
    folder is only read: a merge it lacks is made in a temporary folder. Returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, get_token

    run = open_run(run_dir, needs=("recipe", "weights", "tokenizer"))
    run_dir = run.path
    token = token or get_token()
    if not token:
        raise HfTuneError("no Hugging Face token: export HF_TOKEN=... (or `hf auth login`), then run the push again")
    adapter = not merged and run.weights() == "adapter"
    base, base_revision = pushed_base(run_dir, base_model, adapter)
    flags = {"--merged": merged, "--private": private, f"--revision {revision}": revision,
             f"--base-model {base_model}": base_model, "--include-manifest": include_manifest,
             "--include-logs": include_logs}
    retry = " ".join([f"hf-tune push {run_dir} --repo-id {repo_id}", *(flag for flag, given in flags.items() if given)])
    with tempfile.TemporaryDirectory(prefix="hf_tune-push-") as staging:
        weights_dir = run_dir / run_folder.MERGED if merged else run_dir
        if merged and not (weights_dir / run_folder.MODEL_CONFIG).is_file():
            weights_dir = Path(merge(run_dir, Path(staging) / run_folder.MERGED)["merged_dir"])
        written = {"README.md": str(render_model_card(run_dir, repo_id, merged=merged, base_model=base_model)).encode()}
        if adapter:
            config = dict(run.adapter_config())
            config.update(base_model_name_or_path=base, revision=base_revision)
            written[run_folder.ADAPTER_CONFIG] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        files = {**upload_plan(run_dir, weights_dir, include_manifest, include_logs), **written}
        operations = [CommitOperationAdd(path, content) for path, content in sorted(files.items())]
        api = HfApi(token=token)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            commit = api.create_commit(repo_id, operations, revision=revision, commit_message="Upload with hf_tune")
        except Exception as err:  # network, auth, quota: the run itself is safe on disk
            first_line = str(err).splitlines()[0] if str(err) else ""
            raise HfTuneError(f"upload to {repo_id} failed: {type(err).__name__}: {first_line}\n"
                              f"  the run folder {run_dir} is unchanged; retry with: {retry}") from None
    return commit.commit_url


def upload_plan(run_dir: Path, weights_dir: Path, include_manifest: bool = False,
                include_logs: bool = False) -> dict[str, Path]:
    """{path in the repo: file} of what a push uploads: weights and tokenizer from ``weights_dir``, the redacted
    recipe and results from ``run_dir``, and the manifest or the tracker logs only when asked for. Never the
    checkpoints, training_args.bin (a pickle) or anything not named in the lists above."""
    plan: dict[str, Path] = {}

    def add(folder: Path, patterns, links: bool = True) -> None:
        for pattern in patterns:
            for path in sorted(folder.glob(pattern)):
                parts = path.relative_to(folder).parts
                linked = any(folder.joinpath(*parts[:i]).is_symlink() for i in range(1, len(parts) + 1))
                if path.is_file() and (links or not linked):
                    plan["/".join(parts)] = path

    add(weights_dir, WEIGHT_FILES + TOKENIZER_FILES)
    add(run_dir, RESULT_FILES)
    if include_manifest:
        add(run_dir, MANIFEST_FILES)
    if include_logs:  # W&B links latest-run and debug.log to files it already holds: each is uploaded once
        add(run_dir, [f"{name}/**/*" for name in TRACKER_LOGS], links=False)
    return plan


def pushed_base(run_dir: Path, base_model: str | None, adapter: bool) -> tuple[str | None, str | None]:
    """(Hub id, revision) of the base model that the upload names: ``base_model`` if given, else the recipe's Hub id
    (an embedded model's is the Hub id its weights came from). An adapter whose base others cannot load is refused."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if base_model:
        try:
            validate_repo_id(base_model)
        except HFValidationError:
            raise HfTuneError(f"--base-model: {base_model!r} is not a Hub id\n  fix: name the base model as ORG/NAME, "
                              "the Hub id that others load it by") from None
        return base_model, None
    model = _recipe_model(run_dir)
    name = model.get("pretrained_model_name_or_path") or ""
    base = base_model_id(name)
    if adapter and (base is None or model.get("gguf_file")):
        what = f"the GGUF file {model['gguf_file']} in {name}" if base else f"the local folder {name}"
        raise HfTuneError(f"{run_dir}: the adapter's base model is {what}, which others cannot load with the adapter "
                          "alone\n  fix: push the merged model with --merged, or name the base model's Hub id with "
                          "--base-model ORG/NAME")
    return base, None if name.startswith("embedded:") else model.get("revision")
