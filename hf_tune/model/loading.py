"""Model and tokenizer from the recipe's ``model`` and ``lora`` sections: local folders, Hub ids, GGUF, embedded
models."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from transformers import AutoTokenizer

from hf_tune.catalog.sources import OFFLINE_MODEL_FIX, looks_like_local_path
from hf_tune.catalog.tasks import task_of
from hf_tune.catalog.templates import template_text
from hf_tune.errors import HfTuneError, RecipeError, stage_errors
from hf_tune.model.attention import loaded_attn_implementation
from hf_tune.model.attention_choice import apply_attention
from hf_tune.model.dropout import use_fast_lora_dropout
from hf_tune.model.embedded import PREFIX, drop_gguf_quantizer, embedded_model_path, is_embedded
from hf_tune.model.moe import moe_lora
from hf_tune.model.new_tokens import (
    add_template_tokens,
    fit_embeddings,
    log_new_tokens,
    new_token_ids,
    trainable_token_indices,
)
from hf_tune.model.quantization import bitsandbytes_config, describe, prepare_for_lora
from hf_tune.model.vision import freeze_vision_tower, freezes_vision, vision_lora_exclusions
from hf_tune.recipe.schema import Recipe
from hf_tune.recipe.upstream import blame_key
from hf_tune.runtime.network import hub_is_reachable

logger = logging.getLogger(__name__)


def resolve_model_path(name: str) -> str:
    """What ``from_pretrained`` gets: embedded names become a local folder; Hub ids and paths pass unchanged."""
    return embedded_model_path(name) if is_embedded(name) else name


def build_tokenizer(recipe: Recipe):
    """The tokenizer, or the processor of a task that reads more than text (``Task.processor``: an image
    processor), as the model's files hold it."""
    m, task = recipe.model, task_of(recipe.model.task)
    path = resolve_model_path(m.pretrained_model_name_or_path)
    if not task.reads_text:
        with stage_errors(_blame_model_key(recipe), f"loading the {task.processor}"):
            return _from_pretrained(task.processor_class, path, recipe, **_source_kwargs(m))
    with stage_errors(_blame_model_key(recipe), "loading the tokenizer"):
        tokenizer = _from_pretrained(AutoTokenizer, path, recipe, **_source_kwargs(m))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # labels come from the assistant mask, so eos is still trained
    if recipe.data.chat_template:
        template = recipe.data.chat_template
        with stage_errors("data.chat_template", "reading the chat template"):
            tokenizer.chat_template = template_text(template)  # the text, a name (chatml, TRL's), or a file
            # a template that does not render fails here, not in the middle of tokenization
            tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
        add_template_tokens(tokenizer, tokenizer.chat_template)  # markers a base model lacks: one token each
    return tokenizer


def stored_in_mxfp4(config) -> bool:
    """Whether a model's checkpoint stores weights in MXFP4 (its config's ``quantization_config``, gpt-oss's)."""
    stored = getattr(config, "quantization_config", None) or {}
    method = stored.get("quant_method") if isinstance(stored, dict) else getattr(stored, "quant_method", None)
    return str(getattr(method, "value", method)) == "mxfp4"


def build_model(recipe: Recipe, tokenizer=None, labels: list[str] | None = None, attention: str | None = None,
                checkpointing: bool | None = None, fall_back=None):
    """The base model, wrapped by PEFT when the recipe has a ``lora`` section. ``labels``: class names of a
    classification recipe (default: read from its training data), stored in the config as id2label / label2id.
    ``attention`` and ``checkpointing``: the run's decisions (``hf_tune.assembly.decisions``; without them, the recipe's
    own keys, and transformers' attention where it names none); ``fall_back(name, value, why)`` is told where the
    model cannot run a decision (flash attention that fails to load)."""
    m, task = recipe.model, task_of(recipe.model.task)
    path = resolve_model_path(m.pretrained_model_name_or_path)
    kwargs = {**_source_kwargs(m), "dtype": m.dtype, "attn_implementation": m.attn_implementation,
              "num_labels": m.num_labels, "device_map": m.device_map,
              "ignore_mismatched_sizes": m.ignore_mismatched_sizes}
    if m.quantization_config:
        kwargs["quantization_config"] = bitsandbytes_config(m.quantization_config)
    elif stored_in_mxfp4(model_config(recipe)):  # gpt-oss: trained dequantized (transformers' own CPU path)
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        logger.info("%s stores its experts in MXFP4: dequantized to %s for training (about 4x their stored bytes)",
                    m.pretrained_model_name_or_path, m.dtype or "the config's dtype")
    if task.num_labels is not None:  # a fixed head (a reward model's one score)
        kwargs["num_labels"] = task.num_labels
    if task.class_labels:
        if labels is None:
            raise HfTuneError(f"model.task {m.task!r} needs the class names of the training data: build_model(recipe, "
                              "tokenizer, labels), or build_model_and_tokenizer(recipe), which reads them")
        if m.num_labels is not None and m.num_labels != len(labels):
            raise RecipeError("model.num_labels", f"is {m.num_labels} but data.train has {len(labels)} classes "
                              f"({labels[:10]})", fix="remove model.num_labels: it is read from the data")
        kwargs.update(num_labels=len(labels), id2label=dict(enumerate(labels)),
                      label2id={name: i for i, name in enumerate(labels)})
    with stage_errors(_blame_model_key(recipe), "building the model"):
        given = {k: v for k, v in kwargs.items() if v is not None}
        model = _from_pretrained(task.model_class, path, recipe, **given)
        # where the weights came from: the reference cache keys on these files (hf_tune/trainer/reference.py)
        model.hf_tune_source = {"name_or_path": path, **{k: v for k, v in _source_kwargs(m).items()
                                                         if k != "trust_remote_code"}}
        drop_gguf_quantizer(model)
        if m.attn_implementation is None and attention is not None and loaded_attn_implementation(model) != attention:
            ran, why = apply_attention(model, attention)  # the decision, applied (flash may fall back)
            if why is not None and fall_back is not None:
                fall_back("attention", ran, why)
    if not task.reads_text:  # a processor: no pad token, no vocabulary to fit
        tokenizer = None
    if freezes_vision(recipe):
        logger.info("vision tower frozen: %d parameters (model.train_vision_tower: false)", freeze_vision_tower(model))
    if tokenizer is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    new_ids = new_token_ids(tokenizer) if tokenizer is not None else []
    if tokenizer is not None:
        rows = fit_embeddings(model, tokenizer)
        log_new_tokens(tokenizer, rows, "with every weight (full fine-tune)" if recipe.lora is None else
                       "through peft's trainable_token_indices" if not _lora_trains_embeddings(recipe.lora) else
                       "as the lora section says")
    return model if recipe.lora is None else wrap_lora(model, recipe, new_ids, checkpointing)


def _lora_trains_embeddings(lora: dict) -> bool:
    """The lora section already says how embeddings train (trainable_token_indices, or embeddings saved whole)."""
    return bool(lora.get("trainable_token_indices")) or any(
        "embed" in name or name in ("wte", "lm_head") for name in lora.get("modules_to_save") or [])


def lora_section(model, recipe: Recipe) -> dict:
    """The recipe's ``lora`` section as PEFT gets it: the vision tower kept out unless ``model.train_vision_tower``
    (``hf_tune.model.vision``), and a mixture of experts' targets resolved (``hf_tune.model.moe``)."""
    return moe_lora(model, vision_lora_exclusions(model, recipe, recipe.lora or {}))


def wrap_lora(model, recipe: Recipe, new_token_ids: list[int] | None = None, checkpointing: bool | None = None):
    """The model wrapped by PEFT with the recipe's ``lora`` section. PEFT's errors name the ``lora`` key; a
    ``target_modules`` that matches nothing lists the model's linear modules to choose from. ``new_token_ids``:
    tokens added for the chat template, whose embedding rows train through ``trainable_token_indices``.
    ``checkpointing``: the run's decision (the recipe's ``training.activation_checkpointing`` when not given)."""
    from peft import LoraConfig, get_peft_model

    lora = lora_section(model, recipe)  # the vision tower kept out unless model.train_vision_tower
    if new_token_ids and not _lora_trains_embeddings(lora):
        lora["trainable_token_indices"] = trainable_token_indices(model, new_token_ids)

    if checkpointing is None:
        checkpointing = bool(recipe.training.get("activation_checkpointing")
                             or recipe.training.get("gradient_checkpointing"))
    if recipe.model.quantization_config:
        model = prepare_for_lora(model, checkpointing, recipe.training.get("activation_checkpointing_kwargs")
                                 or recipe.training.get("gradient_checkpointing_kwargs"))
        logger.info("QLoRA: %s base prepared with peft.prepare_model_for_kbit_training (gradient checkpointing %s, "
                    "as training.activation_checkpointing says)", describe(recipe.model.quantization_config),
                    "on" if checkpointing else "off")
    elif checkpointing:
        model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need an input that requires grad
    with stage_errors(lambda message: blame_key("lora", recipe.lora, message), "wrapping the model with PEFT"):
        try:
            model = get_peft_model(model, LoraConfig(task_type=task_of(recipe.model.task).peft_task_type, **lora))
        except ValueError as err:
            if not _matches_no_module(err):
                raise
            names = linear_module_names(model)
            raise RecipeError("lora.target_modules", f"{recipe.lora.get('target_modules')!r} matches no module of "
                              f"the model; its linear modules are: {', '.join(names)}", fix=f"name some of them "
                              f"(e.g. lora.target_modules=[{', '.join(names[:2])}]), or all-linear") from err
    name_adapter_base(model, recipe)
    if recipe.model.fast_lora_dropout:
        swapped = use_fast_lora_dropout(model)
        logger.info("LoRA dropout: hf_tune.model.dropout.FastDropout in %d layers (model.fast_lora_dropout)", swapped)
    return model


def name_adapter_base(model, recipe: Recipe) -> None:
    """The base that every saved ``adapter_config.json`` names, so a run folder loads on another machine: an
    embedded model by its ``embedded:NAME`` (PEFT would write this machine's cache path; hf_tune resolves the name,
    ``records.run_reader.load_adapter_run``), a Hub model by its id and the recipe's revision. A local folder keeps
    its path: nothing else names it."""
    name, revision = recipe.model.pretrained_model_name_or_path, recipe.model.revision
    if not is_embedded(name) and looks_like_local_path(name):
        return
    for config in model.peft_config.values():
        config.base_model_name_or_path = name
        config.revision = None if is_embedded(name) else revision
    if is_embedded(name):  # PEFT's save looks for NAME/config.json to see whether the vocabulary grew; hf_tune's
        # new tokens train through trainable_token_indices or a LoRA on the embeddings, which PEFT saves without it
        warnings.filterwarnings("ignore", message=f"Could not find a config file in {PREFIX}")


def linear_module_names(model) -> list[str]:
    """Short names (the last part of the dotted path) of the model's linear layers, each once, sorted."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, (torch.nn.Linear, Conv1D))})


def _matches_no_module(err: BaseException | None) -> bool:
    """PEFT's "no target module found": NoMatchingPeftModuleError in recent PEFT, a plain ValueError before."""
    import peft

    no_match = getattr(peft, "NoMatchingPeftModuleError", None)
    return (no_match is not None and isinstance(err, no_match)) or (
        isinstance(err, ValueError) and "not found in the base model" in str(err))


def model_class(recipe: Recipe, model=None) -> type:
    """The class of the (base) model: from a built model, unwrapped from PEFT, or else from the recipe's config."""
    if model is not None:
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        return type(model)
    return task_model_class(recipe, model_config(recipe))


def task_model_class(recipe: Recipe, config) -> type:
    """The class the recipe's task builds for this config (the task's Auto class's own mapping), or a ``RecipeError``
    naming ``model.task`` where the model is not of that kind (a vision-language task on a text-only model)."""
    task = task_of(recipe.model.task)
    try:
        return task.model_class._model_mapping[type(config)]
    except KeyError:
        raise RecipeError("model.task", f"{recipe.model.pretrained_model_name_or_path} is a {config.model_type} "
                          f"model, which has no {task.model_class.__name__} class in transformers: it is not a model "
                          f"for task {recipe.model.task}", fix="pick a model of that kind, or the task this model has "
                          "(model.task: causal_lm for a text-only language model)") from None


def model_config(recipe: Recipe):
    """The model's config, read from the recipe's model files (no weight is read)."""
    from transformers import AutoConfig

    m = recipe.model
    return _from_pretrained(AutoConfig, resolve_model_path(m.pretrained_model_name_or_path), recipe,
                            **_source_kwargs(m))


def _source_kwargs(m) -> dict:
    """Where the files come from, for config, tokenizer and model alike. No ``token``: the Hub client reads
    ``HF_TOKEN`` or the ``hf auth login`` token itself, and a recipe holding one is refused."""
    return {"revision": m.revision, "gguf_file": m.gguf_file, "trust_remote_code": m.trust_remote_code,
            "cache_dir": m.cache_dir, "subfolder": m.subfolder}


def _blame_model_key(recipe: Recipe):
    """The ``model`` key an error message is about: ``gguf_file`` when it names the file, else as blame_key finds."""
    m = recipe.model

    def blame(message: str) -> str:
        if m.gguf_file and m.gguf_file in message:
            return "model.gguf_file"
        return blame_key("model", m.model_dump(exclude_none=True), message)
    return blame


def _from_pretrained(cls, path: str, recipe: Recipe, **kwargs):
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    folder = Path(path).expanduser()
    if kwargs.get("subfolder") and folder.is_dir() and not (folder / kwargs["subfolder"]).is_dir():
        raise RecipeError("model.subfolder", f"{path} has no folder {kwargs['subfolder']!r}",
                          fix="name the folder inside it that holds config.json, or remove model.subfolder")
    if not Path(path).expanduser().is_dir() and not hub_is_reachable():
        logger.info("The Hub is unreachable: loading %s from the local cache only", path)
        kwargs["local_files_only"] = True
    try:
        return cls.from_pretrained(path, **kwargs)
    except ValueError as err:  # a config whose model_type this transformers does not know
        if "does not recognize this architecture" not in str(err):  # transformers' words for an unknown model_type
            raise
        import transformers

        name, first = recipe.model.pretrained_model_name_or_path, str(err).splitlines()[0][:160]
        raise RecipeError("model.pretrained_model_name_or_path", f"cannot read {name!r}: its config names an "
                          f"architecture transformers {transformers.__version__} does not know ({first})",
                          fix="upgrade transformers if the architecture is "
                          "newer, set model.trust_remote_code: true if the repository ships its own code, or fix "
                          "model_type in its config.json") from None
    except OSError as err:
        name = recipe.model.pretrained_model_name_or_path
        if recipe.model.gguf_file and recipe.model.gguf_file in str(err):
            raise RecipeError("model.gguf_file", f"cannot load {name!r}: {str(err).splitlines()[0]}",
                              fix="name a .gguf file that the folder or Hub repository holds") from err
        raise RecipeError("model.pretrained_model_name_or_path", f"cannot load {name!r}: {str(err).splitlines()[0]}",
                          fix=OFFLINE_MODEL_FIX) from err
