"""Reference log-probabilities computed once and kept across runs (methods with a reference model: dpo, kto).

TRL's ``precompute_ref_log_probs`` computes them before training, but keys its cache by a hash of the whole model,
LoRA adapter included, so a new seed, a searched ``lora.r`` or another process computes them again. Here the key is
what they depend on: the tokenized examples the trainer built (so the data, the tokenizer and the chat template),
the reference weights (the frozen ones: the base under LoRA), the dtype and the method's settings that change them.
Reruns, resumed runs and search trials then reuse them. The cache lives in ``$HF_TUNE_CACHE/reference_logps``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pyarrow as pa
import torch
from datasets import Dataset, concatenate_datasets

from hf_tune.errors import RecipeError

logger = logging.getLogger(__name__)

# the config values that change the reference log-probabilities of the same examples
_SETTINGS = ("max_length", "truncation_mode", "ld_alpha", "bf16", "fp16", "max_prompt_length",
             "max_completion_length")


def reference_cache_dir() -> Path:
    from hf_tune.model.embedded import cache_dir

    return cache_dir() / "reference_logps"


def examples_digest(dataset: Dataset) -> str:
    """sha256 of the examples as the trainer tokenized them (every column, in order, indices applied)."""
    table = dataset.with_format("arrow")[:]
    table = table.select(sorted(table.column_names))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def reference_weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the weights the reference runs with: the frozen parameters and the buffers (under LoRA the base;
    in a full fine-tune every parameter, as the reference is the model before its first step)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if frozen and name in trainable:
            continue
        h.update(name.encode() + str(tensor.dtype).encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ReferenceLogpsCache:
    """Mixin over a TRL trainer with ``_precompute_ref_logps`` (DPO, KTO): the reference log-probabilities of a
    dataset are read from the cache when present, and stored in it after TRL computed them."""

    # A private TRL hook, and the one place its precomputation can be reused (see the module docstring).
    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        if len(dataset) == 0:  # TRL drops the pairs whose prompt alone fills max_length (truncation_mode keep_start)
            raise RecipeError("training.max_length", f"every prompt of the {name} data fills it "
                              f"({self.args.max_length} tokens), so no pair is left to train on",
                              fix="raise training.max_length, or set training.truncation_mode: keep_end")
        base = self.ref_model or self.accelerator.unwrap_model(self.model)
        parts = [getattr(self, "_name", type(self).__name__), examples_digest(dataset), reference_weights_digest(base),
                 *(f"{k}={getattr(self.args, k, None)}" for k in _SETTINGS)]
        key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
        path = reference_cache_dir() / f"{key}.parquet"
        if path.is_file():
            cached = Dataset.from_parquet(str(path))
            if len(cached) == len(dataset):
                logger.info("Reference log-probabilities of the %s data: reused from %s", name, path)
                self.reference_cache_hits = getattr(self, "reference_cache_hits", 0) + 1
                return concatenate_datasets([dataset, cached], axis=1)
        result = super()._precompute_ref_logps(dataset, name, batch_size)
        if self.accelerator.is_main_process:
            added = [c for c in result.column_names if c not in dataset.column_names]
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            result.select_columns(added).to_parquet(str(partial))
            os.replace(partial, path)  # atomic: a crash leaves no half-written cache entry
            logger.info("Reference log-probabilities of the %s data: computed, cached in %s", name, path)
        return result
