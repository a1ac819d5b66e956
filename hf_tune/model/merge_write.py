"""Writing a planned shard merge (``hf_tune.model.merge.plan_shard_merge``): each of the base's safetensors shards
read tensor by tensor, the LoRA delta added where the plan puts one, written in the target dtype, with the index and
the configs."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from hf_tune.model.merge import CAST, DTYPE_BYTES, FLOATS, INDEX, SAFETENSORS_DTYPES, ShardMerge


def write_merged_shards(plan: ShardMerge, out: Path, dtype: str) -> dict:
    """Write the merged model to ``out``: one shard per base shard, each written tensor by tensor (read, merged,
    written, freed), the index, the config (its dtype, and untied embeddings where the adapter changed one of them)
    and the generation config."""
    from safetensors import safe_open

    target = getattr(torch, dtype)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / INDEX]:  # a previous merge's shards would mix with ours
        stale.unlink(missing_ok=True)
    count = len(plan.shards)
    files = ["model.safetensors"] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                      for i in range(1, count + 1)]
    copy = plan.untie if plan.untie and plan.untie[1] not in plan.present else None  # (input, output) weight names
    weight_map, total = {}, 0
    for shard, name in zip(plan.shards, files):
        with safe_open(plan.folder / shard, framework="pt") as f:
            entries = []  # (name written, name read, shape, safetensors dtype written)
            for key in f.keys():
                kind = f.get_slice(key).get_dtype()
                entry = (list(f.get_slice(key).get_shape()), SAFETENSORS_DTYPES[target] if kind in FLOATS else kind)
                entries += [(key, key, *entry)] + ([(copy[1], key, *entry)] if copy and key == copy[0] else [])
            total += _write_safetensors(out / name, entries, lambda written, read: _merged(
                f.get_tensor(read), plan, written, target))
        weight_map.update({written: name for written, *_ in entries})
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    _write_configs(plan, out, dtype)
    return {"shards": count, "bytes": total, "merged_tensors": len(plan.deltas) + len(plan.experts),
            "untied_embeddings": bool(plan.untie)}


def _write_safetensors(path: Path, entries: list[tuple], tensor_of) -> int:
    """Write a safetensors file one tensor at a time: the header first (every shape and dtype is known from the base's
    headers), then each tensor's bytes as ``tensor_of(name written, name read)`` makes them. safetensors' own
    save_file needs every tensor of the file in memory at once. Returns the bytes of tensor data written."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for written, _, shape, kind in entries:
        size = math.prod(shape) * DTYPE_BYTES[kind]
        header[written] = {"dtype": kind, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        for written, read, shape, kind in entries:
            tensor = tensor_of(written, read).contiguous()
            if list(tensor.shape) != shape or tensor.element_size() != DTYPE_BYTES[kind]:
                raise RuntimeError(f"{written}: {tensor.dtype} {list(tensor.shape)}, its header says {kind} {shape}")
            file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return offset


def _merged(tensor: torch.Tensor, plan: ShardMerge, key: str, target: torch.dtype) -> torch.Tensor:
    if key in plan.expert_sources:  # one expert's projection, a slice of a fused tensor's delta
        parameter, expert, first, last = plan.expert_sources[key]
        return (tensor.float() + plan.fused_delta(parameter)[expert, first:last]).to(target)
    if key in plan.experts:
        return (tensor.float() + plan.fused_delta(key)).to(target)
    delta = plan.deltas.get(key)
    if delta is None:
        return tensor.to(target) if tensor.dtype in CAST else tensor
    base = tensor if delta.base is None else delta.base  # PEFT loads a saved base weight over the checkpoint's
    return (base.float() + delta.weight(key in plan.transposed)).to(target)


def _write_configs(plan: ShardMerge, out: Path, dtype: str) -> None:
    from transformers import GenerationConfig

    config = plan.config
    config.dtype = dtype
    if plan.untie:
        for section in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
            section.tie_word_embeddings = False
    config.save_pretrained(out)
    try:
        generation = GenerationConfig.from_pretrained(plan.folder)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(out)
