"""Model and tokenizer from the recipe's ``model`` and ``lora`` sections: local folders, Hub ids, GGUF, embedded models."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hf_tune.attention import NAME as SDPA_VARLEN, default_attn_implementation
from hf_tune.embedded import drop_gguf_quantizer, embedded_model_path, is_embedded
from hf_tune.errors import RecipeError
from hf_tune.hub import hub_is_reachable
from hf_tune.recipe.loading import OFFLINE_MODEL_FIX, Recipe

logger = logging.getLogger(__name__)

MODEL_CLASSES = {"causal_lm": AutoModelForCausalLM, "sequence_classification": AutoModelForSequenceClassification}
PEFT_TASK_TYPES = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}


def resolve_model_path(name: str) -> str:
    """What ``from_pretrained`` gets: embedded names become a local folder; Hub ids and paths pass unchanged."""
    return embedded_model_path(name) if is_embedded(name) else name


def build_tokenizer(recipe: Recipe):
    m = recipe.model
    path = resolve_model_path(m.pretrained_model_name_or_path)
    tokenizer = _from_pretrained(AutoTokenizer, path, recipe, revision=m.revision, gguf_file=m.gguf_file,
                                 trust_remote_code=m.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # labels come from the assistant mask, so eos is still trained
    if recipe.data.chat_template:
        template = recipe.data.chat_template
        tokenizer.chat_template = template if "{" in template else Path(template).read_text()
    return tokenizer


def build_model(recipe: Recipe, tokenizer=None, labels: list[str] | None = None):
    """The base model, wrapped by PEFT when the recipe has a ``lora`` section. ``labels``: class names of a
    classification recipe (default: read from its training data), stored in the config as id2label / label2id."""
    m = recipe.model
    path = resolve_model_path(m.pretrained_model_name_or_path)
    kwargs = {"revision": m.revision, "gguf_file": m.gguf_file, "trust_remote_code": m.trust_remote_code,
              "dtype": m.dtype, "attn_implementation": m.attn_implementation, "num_labels": m.num_labels}
    if m.task == "sequence_classification":  # the recipe checks pair it with format: classification
        from hf_tune.data import dataset_labels

        labels = labels or dataset_labels(recipe)
        if m.num_labels is not None and m.num_labels != len(labels):
            raise RecipeError("model.num_labels", f"is {m.num_labels} but data.train has {len(labels)} classes "
                              f"({labels[:10]})", fix="remove model.num_labels: it is read from the data")
        kwargs.update(num_labels=len(labels), id2label=dict(enumerate(labels)),
                      label2id={name: i for i, name in enumerate(labels)})
    model = _from_pretrained(MODEL_CLASSES[m.task], path, recipe, **{k: v for k, v in kwargs.items() if v is not None})
    drop_gguf_quantizer(model)
    if (m.attn_implementation is None and model.config._attn_implementation == "sdpa"
            and default_attn_implementation(m.task, type(model)) == SDPA_VARLEN):
        model.set_attn_implementation(SDPA_VARLEN)  # transformers' SDPA, but flattened examples attend apart
    if tokenizer is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if recipe.lora is not None:
        from peft import LoraConfig, get_peft_model

        if recipe.training.get("activation_checkpointing") or recipe.training.get("gradient_checkpointing"):
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need an input that requires grad
        model = get_peft_model(model, LoraConfig(task_type=PEFT_TASK_TYPES[m.task], **recipe.lora))
        if m.fast_lora_dropout:
            from hf_tune.dropout import use_fast_lora_dropout

            swapped = use_fast_lora_dropout(model)
            logger.info("LoRA dropout: hf_tune.dropout.FastDropout in %d layers (model.fast_lora_dropout)", swapped)
    return model


def model_class(recipe: Recipe, model=None) -> type:
    """The class of the (base) model: from a built model, unwrapped from PEFT, or else from the recipe's config."""
    if model is not None:
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        return type(model)
    from transformers import AutoConfig

    m = recipe.model
    config = _from_pretrained(AutoConfig, resolve_model_path(m.pretrained_model_name_or_path), recipe,
                              revision=m.revision, gguf_file=m.gguf_file, trust_remote_code=m.trust_remote_code)
    return MODEL_CLASSES[m.task]._model_mapping[type(config)]


def build_model_and_tokenizer(recipe: Recipe):
    tokenizer = build_tokenizer(recipe)
    return build_model(recipe, tokenizer), tokenizer


def _from_pretrained(cls, path: str, recipe: Recipe, **kwargs):
    if not Path(path).expanduser().is_dir() and not hub_is_reachable():
        logger.info("The Hub is unreachable: loading %s from the local cache only", path)
        kwargs["local_files_only"] = True
    try:
        return cls.from_pretrained(path, **kwargs)
    except OSError as err:
        name = recipe.model.pretrained_model_name_or_path
        raise RecipeError(
            "model.pretrained_model_name_or_path",
            f"cannot load {name!r}: {str(err).splitlines()[0]}",
            fix=OFFLINE_MODEL_FIX,
        ) from None
