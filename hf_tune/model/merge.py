"""Merge a LoRA adapter into its base model one safetensors shard at a time: each tensor the adapter targets becomes
W + scale * B @ A (computed in float32, then cast to the target dtype), every other tensor is cast, and each base
shard becomes one shard of the merged model. Peak memory is about one shard plus the adapter, whatever the model's size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hf_tune.model.merge_experts import (
    CannotStreamExperts,
    ExpertTarget,
    checkpoint_sources,
    expert_delta,
    expert_targets,
)
from hf_tune.runtime.network import hub_is_reachable

logger = logging.getLogger(__name__)

ADAPTER_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model, in a saved adapter's keys
FACTOR_SUFFIXES = {"lora_A.weight": "A", "lora_B.weight": "B", "lora_embedding_A": "A", "lora_embedding_B": "B"}
# adapter_config.json keys of LoRA variants whose merge is not W + scale * B @ A, or that train more than A and B
VARIANT_KEYS = ("use_dora", "lora_bias", "trainable_token_indices", "modules_to_save", "layer_replication",
                "alora_invocation_tokens", "use_qalora", "alpha_pattern", "megatron_config",
                "use_bdlora", "arrow_config", "kasa_config", "velora_config", "monteclora_config",
                "ensure_weight_tying")
PLAIN_INITS = (True, False, "gaussian")  # pissa, olora, corda, eva, loftq, lora_ga may rewrite the base weights
BASE_WEIGHT = "base_layer.weight"  # an embedding layer's weight saved with the adapter; PEFT loads it over the base's
INDEX = "model.safetensors.index.json"
# the floating dtypes a merge casts to --dtype, as torch and safetensors name them (others, e.g. int buffers, are kept)
CAST = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64"}
SAFETENSORS_DTYPES, FLOATS = CAST, set(CAST.values())
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


class CannotStream(Exception):
    """Why a run cannot be merged by shard, naming the key or file; the caller merges through PEFT instead."""


@dataclass(frozen=True)
class LoraDelta:
    """One module's LoRA factors: its weight changes by ``scale * B @ A`` (transposed for (in, out) layouts)."""
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    embedding: bool  # nn.Embedding's LoRA (lora_embedding_A / _B): PEFT's delta is (B @ A).T
    base: torch.Tensor | None = None  # the layer's base weight saved with the adapter (PEFT's save_embedding_layers)

    def weight(self, transposed: bool) -> torch.Tensor:
        product = self.b.float() @ self.a.float()
        return (product.T if transposed else product) * self.scale


@dataclass
class ShardMerge:
    """What a merge by shard reads and writes, decided from the files' headers before any weight is read."""
    folder: Path  # the base's safetensors (a local folder or a Hub snapshot)
    shards: list[str]  # the base's shard files, in order
    deltas: dict[str, LoraDelta]  # {weight name in the checkpoint: its delta}
    transposed: set[str]  # weight names stored (in, out): Conv1D (GPT-2) and embeddings
    untie: tuple[str, str] | None = None  # (input embedding, output embedding) weights written apart
    config: object = None  # the base's PretrainedConfig
    present: set[str] = field(default_factory=set)  # every tensor name of the base's checkpoint
    # a mixture of experts' fused tensors LoRA adapts (target_parameters): {parameter: (its factors, its layout)}, and
    # the checkpoint's per-expert tensors that make one up: {tensor: (parameter, expert, first row, last row + 1)}
    experts: dict[str, tuple[LoraDelta, ExpertTarget]] = field(default_factory=dict)
    expert_sources: dict[str, tuple[str, int, int, int]] = field(default_factory=dict)
    _fused: dict[str, torch.Tensor] = field(default_factory=dict)  # the last fused delta computed (one at a time)

    def fused_delta(self, parameter: str) -> torch.Tensor:
        if parameter not in self._fused:
            delta, target = self.experts[parameter]
            self._fused.clear()
            self._fused[parameter] = expert_delta(delta.a, delta.b, delta.scale, target)
        return self._fused[parameter]


def read_lora_deltas(adapter_dir: Path) -> dict[str, LoraDelta]:
    """{module name: LoraDelta} of a saved plain-LoRA adapter; CannotStream names the key of any other variant."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise CannotStream(f"adapter_config.json: peft_type is {config.get('peft_type')!r}, not LORA")
    for key in VARIANT_KEYS:
        if config.get(key):
            raise CannotStream(f"adapter_config.json: {key} = {config[key]!r} (its merge is PEFT's)")
    if config.get("bias", "none") != "none" or config.get("init_lora_weights", True) not in PLAIN_INITS:
        key = "bias" if config.get("bias", "none") != "none" else "init_lora_weights"
        raise CannotStream(f"adapter_config.json: {key} = {config[key]!r} (its merge is PEFT's)")
    path = adapter_dir / "adapter_model.safetensors"
    if not path.is_file():
        raise CannotStream(f"{adapter_dir}: no adapter_model.safetensors")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(path).items():
        suffix = next((s for s in (*FACTOR_SUFFIXES, BASE_WEIGHT) if key.endswith("." + s)), None)
        if suffix is None or not key.startswith(ADAPTER_PREFIX) or tensor.ndim != 2:
            raise CannotStream(f"adapter_model.safetensors: {key} is not a LoRA A or B matrix of a linear layer")
        factors.setdefault(key[len(ADAPTER_PREFIX):-len(suffix) - 1], {})[suffix] = tensor
    deltas = {}
    for module, pair in factors.items():
        embedding = "lora_embedding_A" in pair or "lora_embedding_B" in pair
        a, b = (pair.get(f"lora_embedding_{x}" if embedding else f"lora_{x}.weight") for x in "AB")
        if a is None or b is None:
            raise CannotStream(f"adapter_model.safetensors: {module} lacks its lora_A or lora_B")
        rank, alpha = a.shape[0], config.get("lora_alpha", 8)  # rank_pattern's rank is the saved A's rows
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        deltas[module] = LoraDelta(a, b, scale, embedding, pair.get(BASE_WEIGHT))
    return deltas


def base_checkpoint_folder(name: str, revision: str | None = None, subfolder: str | None = None,
                           cache_dir: str | None = None) -> Path:
    """The folder holding the base's safetensors: a local folder, or the Hub snapshot (only the safetensors and
    JSON files, from the cache when the Hub is unreachable)."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        prefix = f"{subfolder.strip('/')}/" if subfolder else ""
        try:
            folder = Path(snapshot_download(name, revision=revision, cache_dir=cache_dir,
                                            allow_patterns=[f"{prefix}*.safetensors", f"{prefix}*.json"],
                                            local_files_only=not hub_is_reachable()))
        except Exception as err:  # not cached offline, unknown repo, gated: PEFT's path reports it in its own words
            raise CannotStream(f"{name}: its files are not at hand ({type(err).__name__})") from err
    folder = folder / subfolder if subfolder else folder
    if not (folder / INDEX).is_file() and not (folder / "model.safetensors").is_file():
        raise CannotStream(f"{folder}: no model.safetensors or {INDEX}")
    return folder


def plan_shard_merge(folder: Path, deltas: dict[str, LoraDelta], model_class: type, trust_remote_code: bool = False,
                     vocab_size: int | None = None, adapter_config: dict | None = None) -> ShardMerge:
    """Check, from the shards' headers and the model's skeleton on the meta device, that every delta lands on a
    weight of the base's checkpoint with its shape; tied embeddings that the adapter changes are written apart. A
    mixture of experts' fused tensors (``adapter_config``'s ``target_parameters``) are placed by
    ``hf_tune.model.merge_experts``."""
    from safetensors import safe_open
    from transformers import AutoConfig
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    index = folder / INDEX
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else ["model.safetensors"]
    shapes = {}
    for shard in shards:
        with safe_open(folder / shard, framework="pt") as f:
            shapes.update({key: list(f.get_slice(key).get_shape()) for key in f.keys()})
    with torch.device("meta"):
        skeleton = model_class.from_config(config, trust_remote_code=trust_remote_code)
    modules = dict(skeleton.named_modules())
    names = {id(module): name for name, module in modules.items()}
    inputs, outputs = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    tied = outputs is not None and inputs is not None and outputs.weight is inputs.weight
    embeddings = (f"{names[id(inputs)]}.weight", f"{names[id(outputs)]}.weight") if tied else None
    plan = ShardMerge(folder, shards, {}, set(), config=config, present=set(shapes))
    experts = _expert_deltas(deltas, model_class, config, adapter_config, trust_remote_code)
    for module, delta in deltas.items():
        if module in experts:
            continue
        if module not in modules:
            raise CannotStream(f"the adapter's module {module} is not in {type(skeleton).__name__}")
        weight = f"{module}.weight"
        transposed = delta.embedding or isinstance(modules[module], Conv1D)
        rows, cols = delta.b.shape[0], delta.a.shape[1]
        source = weight if weight in shapes or not tied or weight != embeddings[1] else embeddings[0]
        if source not in shapes:
            raise CannotStream(f"{weight} (changed by the adapter) is not a tensor of the base's checkpoint")
        shape = [cols, rows] if transposed else [rows, cols]
        if shapes[source] != shape or (delta.base is not None and list(delta.base.shape) != shape):
            raise CannotStream(f"{weight}: the adapter's delta does not fit its shape {shapes[source]}")
        plan.deltas[weight] = delta
        if transposed:
            plan.transposed.add(weight)
    _place_experts(plan, experts, shapes)
    if tied and (embeddings[0] in plan.deltas or embeddings[1] in plan.deltas):
        plan.untie = embeddings  # base + adapter reads the input and the output embeddings apart
    if vocab_size and inputs is not None:
        rows = shapes.get(f"{names[id(inputs)]}.weight", [vocab_size])[0]
        if rows < vocab_size:
            raise CannotStream(f"the run's tokenizer has {vocab_size} tokens, the base's embeddings {rows} rows")
    return plan


def _expert_deltas(deltas: dict[str, LoraDelta], model_class: type, config, adapter_config: dict | None,
                   trust_remote_code: bool) -> dict[str, tuple[LoraDelta, ExpertTarget]]:
    """{the adapter's module: (its factors with the scale of its rank, the fused tensor it adapts)} for the adapter's
    ``target_parameters`` (none without them)."""
    if not (adapter_config or {}).get("target_parameters"):
        return {}
    with torch.device("meta"):
        skeleton = model_class.from_config(config, trust_remote_code=trust_remote_code)
    try:
        targets = expert_targets(skeleton, adapter_config)
    except Exception as err:  # PEFT cannot apply the adapter's config to the skeleton: PEFT's merge will say why
        raise CannotStream(f"adapter_config.json: target_parameters: {type(err).__name__}: {err}") from err
    found = {}
    for module, delta in deltas.items():
        if module in targets:
            target = targets[module]
            rank = delta.a.shape[0] // target.shape[0]  # A holds each expert's rank rows
            alpha = adapter_config.get("lora_alpha", 8)
            scale = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
            found[module] = (dataclasses.replace(delta, scale=scale), target)
    return found


def _place_experts(plan: ShardMerge, experts: dict[str, tuple[LoraDelta, ExpertTarget]], shapes: dict) -> None:
    """Where each adapted fused tensor lives in the checkpoint: as it is, or one tensor per expert and projection."""
    for delta, target in experts.values():
        plan.experts[target.parameter] = (delta, target)
        if target.parameter in shapes and shapes[target.parameter] != list(target.shape):
            raise CannotStream(f"{target.parameter}: the adapter's delta does not fit its shape "
                               f"{shapes[target.parameter]}")
    try:
        plan.expert_sources = checkpoint_sources(set(shapes), shapes, plan.config.model_type, set(plan.experts))
    except CannotStreamExperts as err:
        raise CannotStream(str(err)) from err
    for key, (parameter, _, first, last) in plan.expert_sources.items():
        fused = plan.experts[parameter][1].shape
        if shapes[key] != [last - first, *fused[2:]]:
            raise CannotStream(f"{key}: its shape {shapes[key]} is not a slice of {parameter} {list(fused)}")
