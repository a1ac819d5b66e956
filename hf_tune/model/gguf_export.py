"""A Hugging Face causal-LM folder written as one GGUF file (llama.cpp, Ollama, LM Studio), read a tensor at a time.

Every name comes from an upstream table: tensor names from the ``gguf`` package's ``TensorNameMap``, metadata keys
from transformers' ``GGUF_CONFIG_MAPPING`` (the table its GGUF loader reads them back with), and the one tensor
transform from transformers' GGUF tensor processors (the ``llama`` architecture's q / k rotary permutation, which its
loader reverses). An architecture whose loader transforms tensors otherwise, or a tensor the name map does not know, is
refused by name: the file is either exact or not written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from hf_tune.catalog.export_formats import GGUF_QUANTS
from hf_tune.errors import HfTuneError

logger = logging.getLogger(__name__)

# --quant: (ggml type of the 2-D weights, llama.cpp's file type); 1-D tensors (norms, biases) stay float32, as
# llama.cpp's converter keeps them, and a q8_0 row not a multiple of its 32-value block falls back to float16
QUANTS = GGUF_QUANTS  # the table's (hf_tune.catalog.export_formats)
PRE_TOKENIZERS = {"qwen2": "qwen2", "qwen3": "qwen2"}  # llama.cpp's pre-tokenizer of a model type's BPE
CONVERTER_HINT = ("  fix: convert the merged folder (hf-tune merge RUN_DIR) with llama.cpp's convert_hf_to_gguf.py, "
                  "which knows more architectures")


@dataclasses.dataclass(frozen=True)
class Export:
    path: Path
    architecture: str
    quant: str
    tensors: int
    bytes: int
    pre_tokenizer: str


def gguf_architecture(config) -> str:
    """The GGUF architecture name of a transformers config, or an error naming why it cannot be exported exactly."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    model_type = config.model_type
    names = {name.replace("-", "").replace("_", ""): name for name in gguf.MODEL_ARCH_NAMES.values()}
    arch = names.get(model_type.replace("_", ""))
    processor = TENSOR_PROCESSORS.get(arch or "")
    if arch is None or model_type not in GGUF_CONFIG_MAPPING or (processor and arch != "llama"):
        raise HfTuneError(f"model_type {model_type!r}: hf_tune exports GGUF for the architectures transformers reads "
                          "back as they are written (llama, qwen2, qwen3, ...), and this is not one of them\n"
                          + CONVERTER_HINT)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise HfTuneError(f"rope_parameters.rope_type {rope['rope_type']!r}: scaled rotary embeddings need tensors "
                          "(rope_freqs) and keys hf_tune does not write yet\n" + CONVERTER_HINT)
    return arch


def write_gguf(model_dir: str | Path, out: str | Path, quant: str = "f16", pre_tokenizer: str | None = None,
               name: str | None = None) -> Export:
    """Write ``model_dir`` (config, safetensors, tokenizer with its chat template) to the GGUF file ``out``, written
    aside and renamed once whole. ``pre_tokenizer``: llama.cpp's name for the tokenizer's pre-tokenization (a GGUF
    base's own; default: the model type's, else llama.cpp's ``default``, which it warns about)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    if quant not in QUANTS:
        raise HfTuneError(f"--quant {quant!r}: one of {', '.join(QUANTS)}")
    model_dir, out = Path(model_dir), Path(out)
    config = AutoConfig.from_pretrained(model_dir)
    arch = gguf_architecture(config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tensors = _checkpoint_tensors(model_dir)
    name_map = gguf.get_tensor_name_map(_arch_enum(arch), config.num_hidden_layers)
    plan = [_tensor_plan(key, shape, name_map, arch, quant, config) for key, (shape, _) in tensors.items()]
    plan = [entry for entry in plan if entry is not None]
    pre = pre_tokenizer or PRE_TOKENIZERS.get(config.model_type, "default")
    if pre == "default":
        logger.warning("llama.cpp will pre-tokenize with its 'default' rules (it names the tokenizer's own by a hash "
                       "of its output, which hf_tune does not keep): check a few prompts there")
    partial = out.with_name(f".{out.name}.partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, arch)
    try:
        _write_metadata(writer, arch, config, quant, name or model_dir.name)
        _write_tokenizer(writer, model_dir, tokenizer, config.vocab_size, pre)
        for entry in plan:
            writer.add_tensor_info(entry.gguf_name, entry.byte_shape, np.dtype(np.uint8), entry.nbytes,
                                   raw_dtype=entry.ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _write_tensors(writer, plan, tensors)
        writer.close()
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
    return Export(out, arch, quant, len(plan), out.stat().st_size, pre)


@dataclasses.dataclass(frozen=True)
class _Planned:
    key: str  # the checkpoint's name
    gguf_name: str
    ggml_type: object  # gguf.GGMLQuantizationType
    byte_shape: tuple[int, ...]  # numpy's (rows, bytes per row) of the stored tensor, as GGUFWriter takes it
    nbytes: int
    permute_heads: int | None  # llama's q / k: the heads of the rotary permutation


def _arch_enum(arch: str):
    import gguf

    return next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)


def _checkpoint_tensors(model_dir: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Every tensor of the folder's safetensors (name -> (shape, file)), in the checkpoint's order, none read."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["model.safetensors"]
    found = {}
    for file in files:
        if not (model_dir / file).is_file():
            raise HfTuneError(f"{model_dir / file}: missing; GGUF export reads a safetensors checkpoint")
        with safe_open(model_dir / file, framework="pt") as handle:
            for key in handle.keys():
                found[key] = (tuple(handle.get_slice(key).get_shape()), model_dir / file)
    return found


def _tensor_plan(key: str, shape: tuple[int, ...], name_map, arch: str, quant: str, config) -> _Planned | None:
    import gguf

    if key == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
        return None  # tied: llama.cpp and transformers' loader reuse token_embd
    name = name_map.get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise HfTuneError(f"tensor {key!r}: the gguf package's name map for this architecture does not know it, so "
                          "no GGUF reader would find it\n" + CONVERTER_HINT)
    ggml = gguf.GGMLQuantizationType
    kind = ggml[QUANTS[quant][0]] if len(shape) >= 2 else ggml.F32
    if kind == ggml.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[ggml.Q8_0][0]:
        kind = ggml.F16
    byte_shape = tuple(gguf.quants.quant_shape_to_byte_shape(shape, kind))
    heads = None
    if arch == "llama":  # the one architecture whose loader (transformers' LlamaTensorProcessor) un-permutes
        if name.endswith("attn_q.weight"):
            heads = config.num_attention_heads
        elif name.endswith("attn_k.weight"):
            heads = config.num_key_value_heads
    return _Planned(key, name, kind, byte_shape, int(np.prod(byte_shape)), heads)


def _write_metadata(writer, arch: str, config, quant: str, name: str) -> None:
    """The architecture's keys, inverted from transformers' reading table, plus the file's type and name."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    for suffix, attribute in GGUF_CONFIG_MAPPING[config.model_type].items():
        value = _config_value(config, attribute)
        if value is None:
            continue
        key = f"{arch}.{suffix}"
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
    head_dim = getattr(config, "head_dim", None)
    if head_dim and head_dim * config.num_attention_heads != config.hidden_size:  # llama.cpp reads it when it differs
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(getattr(gguf.LlamaFileType, QUANTS[quant][1]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _config_value(config, attribute: str | None):
    if attribute is None:
        return None
    if attribute == "rope_theta":  # transformers 5 keeps it in rope_parameters
        return (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    return getattr(config, attribute, None)


def _write_tokenizer(writer, model_dir: Path, tokenizer, vocab_size: int, pre: str) -> None:
    """A byte-level BPE vocabulary as llama.cpp's ``gpt2`` tokenizer: tokens by id (special added tokens as control
    tokens, padding rows past the tokenizer as unused), merges, special ids, add-BOS, and the chat template."""
    import gguf

    spec = json.loads((model_dir / "tokenizer.json").read_text()) if (model_dir / "tokenizer.json").is_file() else {}
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise HfTuneError(f"{model_dir / 'tokenizer.json'}: a {model.get('type') or 'non-fast'} tokenizer"
                          f"{' with byte fallback' if model.get('byte_fallback') else ''}; hf_tune writes GGUF for "
                          "byte-level BPE tokenizers (GPT-2's, Llama 3's, Qwen's, SmolLM's)\n" + CONVERTER_HINT)
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    size = max(vocab_size, len(by_id))
    tokens, types = [], []
    for index in range(size):
        if index in added:
            tokens.append(added[index].content)
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        elif index in by_id:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_add_space_prefix(_adds_prefix_space(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=size)
    if not special.merges:
        raise HfTuneError(f"{model_dir / 'tokenizer.json'}: no BPE merges found; the GGUF tokenizer needs them")
    special.chat_template = tokenizer.chat_template  # the template the run trained with, whichever file holds it
    special.add_to_gguf(writer, quiet=True)
    if "bos" not in special.add_special_token:  # transformers 5 saves no add_bos_token: what encoding does
        ids = tokenizer("a")["input_ids"]
        writer.add_add_bos_token(tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id])


def _adds_prefix_space(pre_tokenizer: dict | None) -> bool:
    """Whether the tokenizer's byte-level step puts a space before the text (in a Sequence or alone)."""
    steps = (pre_tokenizer or {}).get("pretokenizers") or [pre_tokenizer or {}]
    return any(step.get("type") == "ByteLevel" and step.get("add_prefix_space") for step in steps)


def _write_tensors(writer, plan: list[_Planned], tensors: dict) -> None:
    """Each tensor read, transformed, converted and written in turn: memory holds one tensor."""
    import gguf
    from safetensors import safe_open
    from tqdm.auto import tqdm

    handles = {}
    try:
        for entry in tqdm(plan, desc="GGUF tensors", unit="tensor"):
            file = tensors[entry.key][1]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt").__enter__()
            tensor = handles[file].get_tensor(entry.key).to(torch.float32)
            if entry.permute_heads:
                tensor = rotary_permuted(tensor, entry.permute_heads)
            writer.write_tensor_data(gguf.quants.quantize(tensor.numpy(), entry.ggml_type))
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


def rotary_permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's layout of a Llama q / k projection: within each head, the rotary halves interleaved (the inverse of
    what transformers' GGUF loader undoes)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
