"""``hf-tune init MODEL --gpus N --gpu-memory GB``: a recipe whose plan fits the machine, each choice commented.

The choices are tried fastest first and the first whose estimated peak per rank (``hf_tune.model.memory``, the numbers
``hf-tune plan`` prints) fits is written: the tuning (full, LoRA, QLoRA), the distribution (DDP, then ZeRO-2, then
ZeRO-3, which partitions what the others replicate), then activation checkpointing and the tokens of a micro-batch.
The model is sized on the meta device from its config, so a 70B recipe is written offline in seconds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from hf_tune.assembly.decisions import decide
from hf_tune.assembly.memory_fit import HEADROOM, estimate_peak
from hf_tune.catalog.formats import DEFAULT_FORMAT
from hf_tune.catalog.templates import fitting_templates, folder_has_template
from hf_tune.errors import HfTuneError, RecipeError, describe_exception
from hf_tune.model.embedded import embedded_model_path, is_embedded
from hf_tune.model.loading import stored_in_mxfp4
from hf_tune.model.memory import RUNTIME_RESERVE_BYTES
from hf_tune.model.meta import build_meta_model, config_model_class, load_model_config
from hf_tune.model.moe import MoeShape, attention_only_targets, moe_shape
from hf_tune.optim.schedule import resolve_schedule
from hf_tune.recipe import validate_recipe
from hf_tune.training_args import build_training_arguments

TUNINGS = ("full", "lora", "qlora")
FULL_AUTO_MAX_PARAMS = 2e9  # auto trains every weight of a model this small when it fits: LoRA saves little there
PLACEHOLDER_DATA = "data/train.jsonl"  # written where --data is not given: the recipe says to put the data there
TOKENS_PER_STEP = 131_072  # effective batch the accumulation aims at: 32 packs of 4k tokens
MICRO_BATCH_TOKENS = (16384, 8192, 4096, 2048, 1024)
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}
# a mixture of experts: LoRA on attention and the experts' fused weights (PEFT's target_parameters, which take no
# dropout), else on attention only with the experts frozen; the routers are never adapted
MOE_LORA = {"experts": {**LORA, "lora_dropout": 0.0}, "attention": LORA}
QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "bfloat16"}
LEARNING_RATE = {"full": 1.0e-5, "lora": 2.0e-4, "qlora": 2.0e-4}


@dataclasses.dataclass
class Choice:
    tuning: str
    experts: str | None  # a mixture of experts' LoRA: "experts" (adapted too) or "attention" (experts frozen)
    setup: str  # a row of hf_tune.model.memory.model_state_memory
    checkpointing: bool
    tokens: int
    accumulation: int
    peak: float
    why: dict[str, str]
    activations: str = "probe"  # how the activations were estimated: "probe" (measured) or "formula"


DEEPSPEED = {"ZeRO-2": "zero2", "ZeRO-3": "zero3"}


def candidate_recipe(model: str, tuning: str, setup: str, checkpointing: bool, tokens: int, accumulation: int,
                     data: str, max_length: int, output_dir: str, lora: dict | None = None,
                     template: str | None = None) -> dict[str, Any]:
    """The recipe of one choice, as a dict of upstream and hf_tune keys (``lora``: the section of a LoRA choice,
    ``LORA`` by default)."""
    training: dict[str, Any] = {
        "output_dir": output_dir, "num_train_epochs": 1, "learning_rate": LEARNING_RATE[tuning], "bf16": True,
        "per_device_train_batch_size": 1, "gradient_accumulation_steps": accumulation, "warmup_steps": 0.03,
        "logging_steps": 10, "save_steps": 200, "save_total_limit": 2}
    if checkpointing:
        training.update(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})
    if setup in DEEPSPEED:
        training["deepspeed"] = DEEPSPEED[setup]
    # a full fine-tune without DeepSpeed keeps float32 weights under bf16 autocast: AdamW updates of bf16 weights
    # round away (DeepSpeed keeps its own float32 master copy of bf16 weights)
    dtype = "float32" if tuning == "full" and setup not in DEEPSPEED else "bfloat16"
    recipe: dict[str, Any] = {"model": {"pretrained_model_name_or_path": model, "dtype": dtype}}
    if tuning == "qlora":
        recipe["model"]["quantization_config"] = dict(QLORA)
    if tuning != "full":
        recipe["lora"] = dict(lora or LORA)
    recipe["data"] = {"format": DEFAULT_FORMAT, "train": {"path": data}, "max_length": max_length,
                      "batch_tokens": tokens}
    if template:  # the base has none: a named one that fits it
        recipe["data"]["chat_template"] = template
    recipe["training"] = training
    recipe["optim"] = {"min_lr_ratio": 0.1}
    return recipe


def estimate(recipe: dict, world: int, models: dict, stand_in: str | None = None) -> tuple[float, str]:
    """The estimated peak per rank of a candidate recipe: ``hf-tune plan``'s own numbers (``plan.plan_memory``).
    ``stand_in``: a data file validated in place of the recipe's, which does not exist yet (no data is read)."""
    if stand_in:
        recipe = {**recipe, "data": {**recipe["data"], "train": {"path": stand_in}}}
    parsed = validate_recipe(recipe)
    parsed = dataclasses.replace(parsed, training=resolve_schedule(parsed.training, parsed.optim))
    # candidates differ in tuning and dtype only (a full fine-tune under DDP keeps float32 weights)
    key = (repr(parsed.lora), bool(parsed.model.quantization_config), parsed.model.dtype)
    if key not in models:
        models[key] = build_meta_model(parsed)
    # the candidate as written (fit=False: each candidate is one point of the search), by plan's own estimate
    args = build_training_arguments(parsed)
    decisions = decide(parsed, args, models[key].config, model=models[key], world=world, fit=False)
    planned = estimate_peak(parsed, args, decisions, models[key], world)
    return planned["peak_per_rank"], planned["activations"]["source"] or "formula"


SETUPS = {"ddp": "no ZeRO (DDP)", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def extra_reasons(moe, experts: str | None, template: str | None, model_type: str, mxfp4: bool,
                  size: int) -> dict[str, str]:
    """The reasons a chosen recipe adds: a mixture of experts, a base without a chat template, an MXFP4 checkpoint."""
    why = moe_reasons(moe, experts) if moe else {}
    if template:
        why["template"] = (f"data.chat_template: {template}: the base's tokenizer has none; names that fit it: "
                           f"{', '.join(fitting_templates(model_type))}")
    if mxfp4:
        why["moe"] += (f"; its MXFP4 checkpoint is dequantized to bf16 for training: {2 * size / 2**30:.0f} GB of "
                       "weights, about 4x what MXFP4 stores of the experts")
    return why


def choose(model: str, gpus: int, gpu_memory_gb: float, tuning: str = "auto", max_length: int = 4096,
           data: str | None = None, output_dir: str | None = None, setup: str = "auto") -> tuple[dict, Choice]:
    """The first candidate, fastest first, whose estimated peak per rank fits ``gpu_memory_gb``; ``tuning`` and
    ``setup`` (ddp, zero2, zero3) narrow the candidates to one. ``data``: the chat data's path (default: the
    placeholder ``data/train.jsonl``, which need not exist yet)."""
    import tempfile

    data = data or PLACEHOLDER_DATA
    stand_in = None
    if not Path(data).is_file():
        stand_in = str(Path(tempfile.mkdtemp(prefix="hf_tune_init_")) / "train.jsonl")
        Path(stand_in).write_text('{"messages": [{"role": "user", "content": "Hi"}, '
                                  '{"role": "assistant", "content": "Hello"}]}\n')
    if tuning not in ("auto", *TUNINGS):
        raise HfTuneError(f"--tuning {tuning!r}: use auto, full, lora or qlora")
    if setup not in ("auto", *SETUPS):
        raise HfTuneError(f"--setup {setup!r}: use auto, ddp, zero2 or zero3")
    output_dir = output_dir or f"runs/{model.rsplit('/', 1)[-1].lower()}"
    budget = HEADROOM * gpu_memory_gb * 2**30
    models: dict = {}
    described = validate_recipe({"model": {"pretrained_model_name_or_path": model},
                                 "data": {"train": {"path": stand_in or data}}})
    config = causal_lm_config(model, described)
    template = missing_template(model, config.model_type)
    base = build_meta_model(described)
    size, moe = sum(p.numel() for p in base.parameters()), moe_shape(base)
    mxfp4 = stored_in_mxfp4(base.config)
    tunings = [tuning] if tuning != "auto" else (
        ["full", "lora", "qlora"] if size <= FULL_AUTO_MAX_PARAMS else ["lora", "qlora"])
    setups = [SETUPS[setup]] if setup != "auto" else ["no ZeRO (DDP)"] if gpus == 1 else list(SETUPS.values())
    tried = []
    for tune in tunings:
        for experts in ("experts", "attention") if moe and tune != "full" else (None,):
            lora = None if experts is None else {**MOE_LORA[experts], "target_modules": "all-linear"
                                                 if experts == "experts" else attention_only_targets(base, moe)}
            for setup in setups:
                for checkpointing in (False, True):
                    for tokens in (t for t in MICRO_BATCH_TOKENS if t >= max_length):
                        accumulation = max(1, round(TOKENS_PER_STEP / (tokens * gpus)))
                        recipe = candidate_recipe(model, tune, setup, checkpointing, tokens, accumulation, data,
                                                  max_length, output_dir, lora, template)
                        recipe["machine"] = {"world_size": gpus, "gpu_memory_gb": gpu_memory_gb}
                        peak, source = estimate(recipe, gpus, models, stand_in)
                        tried.append(peak)
                        if peak <= budget and (checkpointing or tokens >= 4096):
                            why = {**reasons(tune, setup, checkpointing, tokens, size, tunings, gpus),
                                   **extra_reasons(moe, experts, template, config.model_type, mxfp4, size)}
                            return recipe, Choice(tune, experts, setup, checkpointing, tokens, accumulation, peak,
                                                  why, source)
    raise HfTuneError(f"{model} ({size / 1e9:.1f}B parameters) fits no recipe on {gpus} x {gpu_memory_gb:g} GB: the "
                      f"smallest estimated peak per rank is {min(tried) / 2**30:.1f} GB\n  fix: more GPUs (--gpus), "
                      f"--tuning qlora, or a shorter --max-length")


def missing_template(model: str, model_type: str) -> str | None:
    """A named chat template for a local base whose tokenizer has none (the first that fits it), else None (it has
    one, or a Hub base's tokenizer files are not here to tell)."""

    folder = Path(embedded_model_path(model) if is_embedded(model) else model).expanduser()
    if not folder.is_dir() or folder_has_template(folder) is not False:
        return None
    return fitting_templates(model_type)[0]


CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")  # a config's architectures


def causal_lm_config(model: str, recipe):
    """The config of the model init writes a recipe for, refused by name, before any estimate, where init cannot
    write one: no readable config, or a model that is not a causal LM (an encoder, an image model)."""
    try:
        config = load_model_config(recipe)
    except (OSError, ValueError) as err:
        raise HfTuneError(f"{model}: no model config to read ({describe_exception(err)})\n  fix: pass a Hub id, or a "
                          "folder holding the model's config.json (with its model_type)") from None
    architectures = list(getattr(config, "architectures", None) or [])
    try:
        config_model_class(recipe, config)
        causal = not architectures or any(name.endswith(CAUSAL_ARCHITECTURES) for name in architectures)
    except RecipeError:  # no causal LM class for this config at all (config_model_class names model.task)
        causal = False
    if not causal:
        named = f" ({', '.join(architectures)})" if architectures else ""
        raise HfTuneError(f"{model}: a {config.model_type} model{named}, not a causal LM: init writes chat "
                          "fine-tunes of causal LMs\n  fix: start from recipes/cls_llrd.yaml (a text classifier) or "
                          "recipes/image_classifier.yaml (an image classifier), or pass a causal LM")
    return config


def reasons(tuning: str, setup: str, checkpointing: bool, tokens: int, size: float, tunings: list[str],
            gpus: int) -> dict[str, str]:
    """One comment for each choice the recipe carries."""
    skipped = tunings[:tunings.index(tuning)]
    why_tuning = {"full": f"every weight trains: {size / 1e9:.1f}B parameters and their AdamW states fit",
                  "lora": "LoRA adapters on every linear layer, base frozen in bf16"
                          + (f" ({', '.join(skipped)} does not fit)" if skipped else ""),
                  "qlora": "QLoRA: the base stored in 4-bit NF4, adapters in bf16"
                           + (f" ({', '.join(skipped)} does not fit)" if skipped else "")}[tuning]
    why_setup = ("one GPU: no distribution" if gpus == 1 and setup not in DEEPSPEED else
                 f"{setup} over {gpus} GPUs: " + {"no ZeRO (DDP)": "every rank holds the whole model (fastest)",
                                                  "ZeRO-2": "gradients and optimizer states partitioned",
                                                  "ZeRO-3": "weights partitioned too (FSDP full_shard is the "
                                                            "same plan)"}[setup])
    return {"tuning": why_tuning, "setup": why_setup,
            "checkpointing": "activation checkpointing: without it the activations do not fit" if checkpointing
            else "no activation checkpointing: the activations fit (it would cost about a third of the speed)",
            "tokens": f"packs of up to {tokens:,} tokens a micro-batch: the largest that fits"}


def moe_reasons(moe: MoeShape, experts: str | None) -> dict[str, str]:
    """The comments of a mixture of experts: its shape, and which LoRA (when one) and why."""
    why = {"moe": f"{moe.describe()}: memory holds every expert, compute runs the active ones"}
    if experts == "experts":
        why["lora"] = ("LoRA on attention and on every expert's fused weights (target_parameters, from all-linear); "
                       "lora_dropout 0: PEFT adapts fused expert tensors only without dropout; the routers stay "
                       "frozen")
    elif experts == "attention":
        why["lora"] = ("LoRA on attention only, the experts and routers frozen: adapters on the experts too do not "
                       "fit (their adapters and optimizer states grow with the expert count)")
    return why


def render(recipe: dict, choice: Choice, model: str, gpus: int, gpu_memory_gb: float) -> str:
    """The recipe as YAML, each choice with its reason in a comment."""
    def block(section: str) -> str:
        return yaml.safe_dump({section: recipe[section]}, sort_keys=False, default_flow_style=False, width=100)

    margin = gpu_memory_gb * 2**30 - choice.peak
    head = [f"# {model} on {gpus} x {gpu_memory_gb:g} GB, written by `hf-tune init` (check it: hf-tune plan THIS.yaml)",
            f"# estimated peak per rank: {choice.peak / 2**30:.1f} GB of {gpu_memory_gb:g} GB, {margin / 2**30:.1f} GB "
            f"({margin / (gpu_memory_gb * 2**30):.0%}) to spare (model states; activations "
            + ("measured by the probe on CPU copies of the model" if choice.activations == "probe" else
               "from a formula: the probe cannot run this model")
            + f"; {RUNTIME_RESERVE_BYTES / 2**30:g} GB of CUDA runtime; at most {HEADROOM:.0%} of the GPU)",
            *(f"# {choice.why[key]}" for key in ("template", "moe", "lora", "tuning")
              if key in choice.why and (key != "tuning" or "lora" not in choice.why)),
            f"# {choice.why['setup']}", f"# {choice.why['checkpointing']}",
            f"# {choice.why['tokens']}; accumulation {choice.accumulation} -> about "
            f"{choice.tokens * choice.accumulation * gpus:,} tokens an optimizer step",
            "# attention, bf16 and Liger kernels: hf_tune decides on the GPU it runs on (see README, GPU quick start)"]
    if recipe["data"]["train"]["path"] == PLACEHOLDER_DATA and not Path(PLACEHOLDER_DATA).is_file():
        head.append(f"# data.train.path: {PLACEHOLDER_DATA} is a placeholder: put your chat JSONL there, or edit it")
    parts = ["\n".join(head)] + [block(section) for section in recipe]
    liger = ("  # use_liger_kernel: true  # on a GPU with `pip install liger-kernel`: Liger's RMSNorm, RoPE and SwiGLU "
             "kernels (the loss stays hf_tune's chunked one)\n")
    return "\n".join(parts).replace("\noptim:", liger + "\noptim:")


def write_recipe(model: str, out: str | Path, gpus: int = 1, gpu_memory_gb: float = 80, **options) -> Choice:
    """Choose a recipe for the machine and write it to ``out``."""
    recipe, choice = choose(model, gpus, gpu_memory_gb, **options)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(render(recipe, choice, model, gpus, gpu_memory_gb))
    return choice


__all__ = ["Choice", "choose", "write_recipe"]
