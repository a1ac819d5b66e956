"""Padding-free packing decided by proof: a tiny random model of the user's architecture, run packed and alone.

A flattened row (one row of concatenated examples, ``position_ids`` restarting at each, the way
``DataCollatorWithFlattening`` builds it) is exact only where no layer mixes the examples. Attention on
transformers' attention interface runs them apart, but convolution, state-space and linear-attention layers of
hybrid models (LFM2, granite-moe-hybrid, MiniMax, ...) read across the boundary. The probe shrinks the model's
config (few layers but every layer type it declares, narrow widths, small vocabulary), builds it randomly
initialised on the CPU in float32, and compares the logits of two examples flattened into one row with each run
alone. The verdict is cached per (model class, transformers version, attention, shrunk config) for the process.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import transformers
from transformers import DataCollatorWithFlattening

logger = logging.getLogger(__name__)

LENGTHS = (11, 7)  # the two probe examples: the second starts where the first one's state would leak in
RELATIVE_TOLERANCE = 1e-4  # largest |packed - alone| over the largest |logit|; float32 noise measured < 1e-5
# Weights drawn 5x wider than the usual 0.02: with the usual init a convolution's gated output is so small that a
# hybrid's leak stays near 1e-4 of the logits; at 0.1 leaks measured 1e-2 to 1 and float32 noise under 1e-5.
INITIALIZER_RANGE = 0.1
SMALL_VOCAB = 256
# Narrow sizes for the config attributes that set widths, heads and experts (by their stored names).
SMALL_SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 96, "ffn_dim": 96, "n_inner": 96,
    "dff": 96, "ffn_hidden_size": 96, "intermediate_size_mlp": 96, "dense_intermediate_size": 96,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "shared_intermediate_size": 32, "expert_ffn_hidden_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "n_group": 1,
    "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "qk_head_dim": 16, "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "rotary_dim": 8,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 8, "ssm_state_size": 16,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "lru_width": 64, "kv_channels": 16, "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,
    "router_hidden_size": 32, "embedding_size": 64, "block_multiple_of": 16,
}
# Attributes whose integer names a layer-count-dependent pattern: with one, the depth is kept as declared.
PATTERN_WORDS = ("period", "interval", "offset", "step", "every", "freq", "replace", "first_k")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The verdict: ``packs`` where the flattened row gave each example's own logits; ``reason`` says why not, or
    how close they were; ``seconds`` how long the probe took when it ran."""

    packs: bool
    reason: str
    max_difference: float | None = None
    largest_logit: float | None = None
    seconds: float = 0.0


_VERDICTS: dict[tuple, ProbeResult] = {}


def probe_padding_free(model_class: type, attn_implementation: str, example_boundaries: bool,
                       config=None) -> ProbeResult:
    """Whether ``model_class`` (with ``config``'s layer types, default: its config class's defaults) gives each
    flattened example its own logits under ``attn_implementation``; computed once per process and logged when not.
    ``example_boundaries``: the row carries ``cu_seq_lens_*`` as the collator adds them for varlen attention."""
    started = time.perf_counter()
    try:
        if config is None or not isinstance(config, model_class.config_class):
            config = model_class.config_class()
        tiny = tiny_config(config)
    except Exception as error:  # a config that cannot be shrunk (or built with defaults) proves nothing
        return _remember(None, model_class, attn_implementation,
                         ProbeResult(False, f"no tiny config: {type(error).__name__}: {error}"[:300]))
    key = (f"{model_class.__module__}.{model_class.__qualname__}", transformers.__version__, attn_implementation,
           example_boundaries, tiny.to_json_string(use_diff=False))
    if key not in _VERDICTS:
        result = _run_probe(model_class, tiny, attn_implementation, example_boundaries)
        _remember(key, model_class, attn_implementation,
                  dataclasses.replace(result, seconds=time.perf_counter() - started))
    return _VERDICTS[key]


def _remember(key, model_class: type, attn_implementation: str, result: ProbeResult) -> ProbeResult:
    if not result.packs and (key is None or key not in _VERDICTS):
        logger.warning("%s: batches stay padded (no padding-free flattening) under %s attention: %s",
                       model_class.__name__, attn_implementation, result.reason)
    if key is not None:
        _VERDICTS[key] = result
    return result


def _run_probe(model_class: type, tiny, attn_implementation: str, example_boundaries: bool) -> ProbeResult:
    """Build the tiny model and compare packed and alone: seeded without touching the caller's random state, on
    one thread (tiny matmuls: thread hand-offs would cost more than the work)."""
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)  # whatever default the caller set (a bf16 plan, a meta-device build)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            try:
                model = model_class(tiny).float().eval()
                if model.config._attn_implementation != attn_implementation:
                    model.set_attn_implementation(attn_implementation)
            except Exception as error:
                return ProbeResult(False, f"cannot build a tiny {model_class.__name__} with {attn_implementation} "
                                          f"attention: {type(error).__name__}: {error}"[:300])
            try:
                packed, alone = packed_and_alone_logits(model, probe_examples(tiny), example_boundaries)
            except Exception as error:
                return ProbeResult(False, f"the flattened row does not run: {type(error).__name__}: {error}"[:300])
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
    return compare(packed, alone)


def compare(packed: torch.Tensor, alone: torch.Tensor) -> ProbeResult:
    """The verdict on the two logits tensors: equal within ``RELATIVE_TOLERANCE`` of the largest logit."""
    difference, largest = float((packed - alone).abs().max()), float(alone.abs().max())
    if not torch.isfinite(packed).all() or not torch.isfinite(alone).all():
        return ProbeResult(False, "the tiny model's logits are not finite", difference, largest)
    if difference <= RELATIVE_TOLERANCE * largest:
        return ProbeResult(True, f"packed logits equal each example alone (max difference {difference:.2g}, "
                                 f"largest logit {largest:.2g})", difference, largest)
    return ProbeResult(False, f"a flattened example's logits differ from the example run alone by up to "
                              f"{difference:.3g} (largest logit {largest:.3g}): a layer mixes the flattened "
                              "examples", difference, largest)


def packed_and_alone_logits(model, examples: list[list[int]], example_boundaries: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the examples flattened into one row (upstream ``DataCollatorWithFlattening``, as hf_tune's
    collator builds it, cache off) and of each example run alone, concatenated: ``[tokens, vocab]`` each."""
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=example_boundaries)
    batch = collate([{"input_ids": ids, "labels": ids} for ids in examples])
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([ids]), use_cache=False).logits[0] for ids in examples])
    return packed.float(), alone.float()


def probe_examples(config) -> list[list[int]]:
    """Two random examples of ``LENGTHS`` tokens, avoiding every special token id the config names (image or
    audio placeholders would ask for inputs the probe does not give)."""
    text = _text_config(config)
    vocab = getattr(text, "vocab_size", SMALL_VOCAB)
    special = set(_token_ids(config.to_dict()))
    ordinary = torch.tensor([i for i in range(min(vocab, SMALL_VOCAB)) if i not in special])
    return [ordinary[torch.randint(len(ordinary), (length,))].tolist() for length in LENGTHS]


def _token_ids(values: dict):
    for name, value in values.items():
        name = str(name)
        if isinstance(value, dict):
            yield from _token_ids(value)
        elif "token" in name and isinstance(value, int) and not isinstance(value, bool):
            yield value
        elif "token" in name and isinstance(value, list):
            yield from (v for v in value if isinstance(v, int))


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def tiny_config(config):
    """``config`` shrunk for the probe: narrow widths, few experts, a small vocabulary and at most one layer of
    each kind the config declares per layer (``layer_types``, ``mlp_layer_types``, ...); sub-configs alike."""
    try:
        return type(config).from_dict(shrink(config.to_dict()))
    except Exception:  # the fewer layers broke a rule of the config (counts that must add up): keep the depth
        return type(config).from_dict(shrink(config.to_dict(), fewer_layers=False))


def shrink(values: dict, fewer_layers: bool = True) -> dict:
    """A config dict with small sizes; nested config dicts shrunk the same way."""
    values = dict(values)
    for name, value in values.items():
        if isinstance(value, dict) and ("hidden_size" in value or "model_type" in value):
            values[name] = shrink(value, fewer_layers)
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    for name, small in SMALL_SIZES.items():
        if isinstance(values.get(name), int) and not isinstance(values[name], bool):
            values[name] = min(values[name], small)
    if isinstance(kv_heads, int) and kv_heads == heads or "num_key_value_heads" in values and kv_heads is None:
        values["num_key_value_heads"] = values["num_attention_heads"]  # multi-head attention stays multi-head
    if "head_dim" in values and values["head_dim"] is None and isinstance(values.get("hidden_size"), int):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]  # a default left to the model
    if isinstance(values.get("initializer_range"), float):
        values["initializer_range"] = INITIALIZER_RANGE
    if isinstance(values.get("qk_rope_head_dim"), int):  # multi-head latent attention: rotary dims are the head's
        values["head_dim"] = values["qk_rope_head_dim"]
        values["qk_head_dim"] = values["qk_rope_head_dim"] + values.get("qk_nope_head_dim", 0)
    if values.get("num_experts_per_tok", 0) is None and isinstance(values.get("n_routed_experts"), int):
        values["num_experts_per_tok"] = SMALL_SIZES["num_experts_per_tok"]  # a default left to the checkpoint
    if isinstance(values.get("vocab_size"), int):
        values["vocab_size"] = min(values["vocab_size"], SMALL_VOCAB)
        _fit_token_ids(values, values["vocab_size"])
    return _fewer_layers(values) if fewer_layers else values


def _fit_token_ids(values: dict, vocab: int) -> None:
    """Special token ids beyond the small vocabulary moved to its top rows (distinct ids stay distinct)."""
    top = vocab - 1
    for name, value in sorted(values.items()):
        if "token" in name and isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            values[name], top = top, top - 1
        elif "token" in name and isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            values[name] = [top - i for i in range(len(value))]
            top -= len(value)


def _fewer_layers(values: dict) -> dict:
    """One layer per distinct combination of the per-layer lists (``layer_types`` and its kin), in order. Without
    such lists, two layers, unless an attribute derives the layer kinds from the depth (a period, an index list):
    then the declared depth is kept, so that no kind of layer goes missing."""
    depth_name = next((n for n in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if n in values), None)
    depth = values.get(depth_name)
    if not isinstance(depth, int) or depth <= 2:
        return values
    about_layers = {name: value for name, value in values.items()
                    if any(word in name for word in ("layer", "block", "pattern")) and isinstance(value, (list, str))}
    per_layer = {name: value for name, value in about_layers.items() if len(value) == depth
                 and all(isinstance(v, (str, int, float, bool)) for v in value)}
    by_layer_index = [name for name, value in values.items() if name not in per_layer and (
        name in about_layers and value  # indices of some layers, or a pattern that repeats
        or "layer" in name and isinstance(value, dict) and value)]  # settings per layer index
    derived = [name for name, value in values.items() if name != depth_name and isinstance(value, int)
               and not isinstance(value, bool) and ("layer" in name or any(w in name for w in PATTERN_WORDS))]
    if by_layer_index or (derived and not per_layer):
        return values
    if not per_layer:
        return {**values, depth_name: 2}
    kinds = list(zip(*per_layer.values()))
    kept = [i for i, kind in enumerate(kinds) if kind not in kinds[:i]]
    shrunk = {name: [value[i] for i in kept] for name, value in per_layer.items()}
    shrunk = {name: "".join(value) if isinstance(values[name], str) else value for name, value in shrunk.items()}
    return {**values, **shrunk, depth_name: len(kept)}
