"""Reference log-probabilities computed once and kept across runs (methods with a reference model: dpo, kto).

TRL's ``precompute_ref_log_probs`` computes them before training, but keys its cache by a hash of the whole model,
LoRA adapter included, so a new seed, a searched ``lora.r`` or another process computes them again. Here the key is
what they depend on: the tokenized examples the trainer built (so the data, the tokenizer and the chat template),
the reference's identity (the base's weight files, or where it has none a hash of its gathered weights), its config
and dtype, the TRL version and the method's settings that change them. Reruns, resumed runs and search trials then
reuse them. The main process decides hit or miss and every rank follows it. The cache lives in
``$HF_TUNE_CACHE/reference_logps``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

import pyarrow as pa
import torch
from datasets import Dataset, concatenate_datasets

from hf_tune.errors import RecipeError
from hf_tune.model.embedded import cache_dir
from hf_tune.trainer.generators import generators_kept

logger = logging.getLogger(__name__)

# the config values that change the reference log-probabilities of the same examples
_SETTINGS = ("max_length", "truncation_mode", "ld_alpha", "bf16", "fp16", "max_prompt_length",
             "max_completion_length")
# weight files as transformers looks for them, preferred first: (sharded index, single file)
_WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"), ("pytorch_model.bin.index.json",
                                                                          "pytorch_model.bin"))
FILE_HASHES = "file_sha256.json"


def reference_cache_dir() -> Path:
    return cache_dir() / "reference_logps"


def examples_digest(dataset: Dataset) -> str:
    """sha256 of the examples as the trainer tokenized them (every column, in order, indices applied), from their
    values alone: Arrow's bytes differ for equal rows (chunking, validity buffers), so they are not hashed."""
    table = dataset.with_format("arrow")[:]
    h = hashlib.sha256()
    for name in sorted(table.column_names):
        h.update(name.encode())
        _update_with_values(h, table.column(name).combine_chunks())
    return h.hexdigest()


def _update_with_values(h, array: pa.Array) -> None:
    """Token lists and numbers as numpy bytes (fast for millions of ids); anything else as JSON."""
    h.update(str(array.type).encode() + array.is_null().to_numpy(zero_copy_only=False).tobytes())
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        h.update(array.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).tobytes())
        _update_with_values(h, array.flatten())
    elif pa.types.is_integer(array.type) or pa.types.is_floating(array.type) or pa.types.is_boolean(array.type):
        filled = array.fill_null(False if pa.types.is_boolean(array.type) else 0)
        h.update(filled.to_numpy(zero_copy_only=False).tobytes())
    else:
        h.update(json.dumps(array.to_pylist(), default=str).encode())


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes. A Hub cache blob is named by it (read nothing); a local file's is computed once and
    kept by path, size and modification time in the cache folder."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", real.name):
        return real.name  # huggingface_hub stores an LFS file under its sha256
    stat = real.stat()
    memo_key = f"{real}:{stat.st_size}:{stat.st_mtime_ns}"
    memo_path = reference_cache_dir() / FILE_HASHES
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    if memo_key not in memo:
        digest = hashlib.sha256()
        with open(real, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
        memo[memo_key] = digest.hexdigest()
        _write_atomically(memo_path, lambda partial: partial.write_text(json.dumps(memo, indent=0)))
    return memo[memo_key]


def model_source(model) -> dict:
    """Where the model's weights were read from: what the loader recorded (``hf_tune_source``: name_or_path,
    revision, subfolder, cache_dir, gguf_file), else its ``name_or_path`` alone."""
    return getattr(model, "hf_tune_source", None) or {"name_or_path": getattr(model, "name_or_path", "") or ""}


def weight_files(source: dict) -> list[Path] | None:
    """The files a model's weights were loaded from, in a local folder or in the Hub cache; None when they cannot be
    told (a model built in memory; a Hub id whose revision was not recorded)."""
    name = str(source.get("name_or_path") or "")
    if not name:
        return None
    root, sub = Path(name).expanduser(), source.get("subfolder") or ""
    if not root.is_dir() and "revision" not in source:
        return None  # a Hub id whose loader recorded no revision: which snapshot it read cannot be told

    def locate(filename: str) -> Path | None:
        if root.is_dir():
            path = root / sub / filename
            return path if path.is_file() else None
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, f"{sub}/{filename}" if sub else filename,
                                       cache_dir=source.get("cache_dir"), revision=source.get("revision"))
        return Path(found) if isinstance(found, str) else None

    if source.get("gguf_file"):
        found = locate(source["gguf_file"])
        return [found] if found else None
    for index_name, single in _WEIGHT_FILES:
        index = locate(index_name)
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index else (
            [single] if locate(single) else [])
        if names:
            files = [locate(n) for n in names]
            return files if all(files) else None
    return None


def files_identity(model) -> str | None:
    """The base's identity from its files (their sha256) and its config; None where the model is not just its
    files: no files found, or embeddings resized after loading (their new rows are drawn at random)."""
    files = weight_files(model_source(model))
    if not files:
        return None
    config_file = files[0].parent / "config.json"
    saved = json.loads(config_file.read_text()) if config_file.is_file() else {}
    saved_rows = saved.get("vocab_size") or (saved.get("text_config") or {}).get("vocab_size")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if saved_rows is None or getattr(embeddings, "num_embeddings", None) != saved_rows:
        return None
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # the same files in another folder are the same base
    parts = [f"{f.name}={file_sha256(f)}" for f in files]
    parts += [json.dumps(config, sort_keys=True, default=str), str(model.dtype)]
    return "files:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()


def gathered_weights_digest(model: torch.nn.Module, is_main_process: bool) -> str | None:
    """sha256 of the weights the reference runs with (the frozen parameters and the buffers; in a full fine-tune
    every parameter), gathered one module at a time under ZeRO-3. Every rank must call it (the gathering is
    collective); the main process returns the digest, the others None."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    frozen_exist = any(not p.requires_grad for p in model.parameters())
    h = hashlib.sha256()
    for module_name, module in model.named_modules():
        tensors = [(n, p) for n, p in module.named_parameters(recurse=False) if not (frozen_exist and p.requires_grad)]
        tensors += list(module.named_buffers(recurse=False))
        if not tensors:
            continue
        sharded = [p for _, p in tensors if hasattr(p, "ds_id")]
        if is_deepspeed_zero3_enabled() and sharded:
            import deepspeed

            with deepspeed.zero.GatheredParameters(sharded, modifier_rank=None):
                _update(h, module_name, tensors, is_main_process)
        else:
            _update(h, module_name, tensors, is_main_process)
    return h.hexdigest() if is_main_process else None


def _update(h, module_name: str, tensors: list, is_main_process: bool) -> None:
    if not is_main_process:
        return
    for name, tensor in tensors:
        h.update(f"{module_name}.{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


def _write_atomically(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    write(partial)
    os.replace(partial, path)  # atomic: a crash leaves no half-written file


class ReferenceLogpsCache:
    """Mixin over a TRL trainer with ``_precompute_ref_logps`` (DPO, KTO): the reference log-probabilities of a
    dataset are read from the cache when present, and stored in it after TRL computed them. The main process decides
    hit or miss and broadcasts the cached columns, so every rank takes the same branch (a miss runs TRL's
    collective pass on all of them)."""

    # A private TRL hook, and the one place its precomputation can be reused (see the module docstring).
    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        from accelerate.utils import broadcast_object_list

        if len(dataset) == 0:  # TRL drops the pairs whose prompt alone fills max_length (truncation_mode keep_start)
            raise RecipeError("training.max_length", f"every prompt of the {name} data fills it "
                              f"({self.args.max_length} tokens), so no pair is left to train on",
                              fix="raise training.max_length, or set training.truncation_mode: keep_end")
        main = self.accelerator.is_main_process
        identity = self._reference_identity()
        path = self._reference_cache_path(dataset, identity) if main else None
        cached = [_read_cached(path, len(dataset)) if main else None]
        broadcast_object_list(cached, from_process=0)
        if cached[0] is not None:
            logger.info("Reference log-probabilities of the %s data: reused from %s", name, path or "the main process")
            self.reference_cache_hits = getattr(self, "reference_cache_hits", 0) + 1
            return concatenate_datasets([dataset, Dataset(cached[0])], axis=1)
        with generators_kept():  # its data loader draws a seed: a miss must leave the run's generators as a hit does
            result = super()._precompute_ref_logps(dataset, name, batch_size)
        if main:
            added = [c for c in result.column_names if c not in dataset.column_names]
            _write_atomically(path, lambda partial: result.select_columns(added).to_parquet(str(partial)))
            logger.info("Reference log-probabilities of the %s data: computed, cached in %s", name, path)
        return result

    def _reference_identity(self) -> str | None:
        """The reference's identity, computed once per trainer: from its files when the main process finds them
        (the choice is broadcast), else a hash of its gathered weights. None on the other ranks."""
        from accelerate.utils import broadcast_object_list

        if hasattr(self, "_reference_identity_value"):
            return self._reference_identity_value
        base = self.accelerator.unwrap_model(self.ref_model or self.model)
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
        main = self.accelerator.is_main_process
        identity = [files_identity(base) if main else None]
        broadcast_object_list(identity, from_process=0)
        if identity[0] is None:
            weights = gathered_weights_digest(base, main)
            identity = [f"weights:{weights}:{base.dtype}" if main else None]
            logger.info("Reference cache: no weight files for the base; keyed by a hash of its weights")
        self._reference_identity_value = identity[0]
        return identity[0]

    def _reference_cache_path(self, dataset: Dataset, identity: str) -> Path:
        import trl

        parts = [getattr(self, "_name", type(self).__name__), f"trl={trl.__version__}", examples_digest(dataset),
                 identity, *(f"{k}={getattr(self.args, k, None)}" for k in _SETTINGS)]
        key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
        return reference_cache_dir() / f"{key}.parquet"


def _read_cached(path: Path, rows: int) -> pa.Table | None:
    """The cached columns at ``path`` when they exist and have one row per example."""
    if not path.is_file():
        return None
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return table if table.num_rows == rows else None
