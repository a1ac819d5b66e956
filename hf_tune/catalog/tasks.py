"""The task table: what each ``model.task`` means to every part of hf_tune. A new task is one entry here plus its
data builder; the rest of the code looks the task up instead of branching on its name."""

from __future__ import annotations

import dataclasses
import importlib

from hf_tune.catalog.formats import formats_trained_by
from hf_tune.catalog.late_bound import resolve


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    auto_class: str  # transformers Auto class of the model
    peft_auto_class: str  # peft AutoPeftModel class that loads a saved adapter of it
    peft_task_type: str | None  # peft.LoraConfig(task_type=...); None: PEFT's plain PeftModel
    pipeline_tag: str  # the Hub's pipeline tag on the model card
    causal: bool  # next-token training: label masks, packs, padding-free batches, the trained-positions loss
    eval_metrics: tuple[str, ...]  # what its evaluation reports besides the evaluation section's metrics
    recipe_metrics: bool  # computes evaluation.metrics (argmax of the logits against the labels)
    class_labels: bool  # a head over classes named by the data (id2label / label2id in the model config)
    num_labels: int | None = None  # a head of a fixed width (a reward model's one score)
    processor: str = "AutoTokenizer"  # transformers Auto class of what turns examples into inputs (processing_class)
    # "module:function" that turns the raw examples into what the model reads: (raw, processor, data section, class
    # names, recipe key) -> Dataset; None: the method's own path (causal LM tokenization, TRL's trainers)
    data_builder: str | None = None
    collator: str | None = None  # "module:Class" built with the processor; None: padding (text), the causal collator
    vision_language: bool = False  # a vision tower beside a language model (frozen unless model.train_vision_tower)
    # "module:function": (processor, task) -> a batch of the model's inputs that `hf-tune merge --check` compares
    # base + adapter and the merged model on (text prompts, drawn images, an image and a question)
    check_inputs: str = "hf_tune.data.tokenization:sample_prompts"
    # a LoRA merge may stream the base's safetensors (hf_tune.model.merge): every adapted weight is in the base's
    # checkpoint; not where PEFT builds or saves a head the base lacks (a classifier's new head, modules_to_save)
    merges_by_shard: bool = False

    @property
    def formats(self) -> tuple[str, ...]:
        """The data.format values it trains on (hf_tune.catalog.formats)."""
        return formats_trained_by(self.name)

    @property
    def reads_text(self) -> bool:
        """Its processor is a tokenizer (pad token, chat template, embeddings sized to the vocabulary)."""
        return self.processor == "AutoTokenizer"

    @property
    def processor_class(self) -> type:
        return getattr(importlib.import_module("transformers"), self.processor)

    @property
    def build_data(self):
        """The data builder, imported on first use."""
        return resolve(self.data_builder)

    @property
    def build_check_inputs(self):
        """The merge check's inputs (``check_inputs``), imported on first use."""
        return resolve(self.check_inputs)

    @property
    def collator_class(self) -> type | None:
        return resolve(self.collator) if self.collator else None

    @property
    def model_class(self) -> type:
        return getattr(importlib.import_module("transformers"), self.auto_class)

    @property
    def peft_model_class(self) -> type:
        return getattr(importlib.import_module("peft"), self.peft_auto_class)


TASKS = {
    "causal_lm": Task("causal_lm", "AutoModelForCausalLM", "AutoPeftModelForCausalLM", "CAUSAL_LM", "text-generation",
                      causal=True, merges_by_shard=True,
                      eval_metrics=("eval_loss", "eval_perplexity"), recipe_metrics=False, class_labels=False),
    "sequence_classification": Task(
        "sequence_classification", "AutoModelForSequenceClassification", "AutoPeftModelForSequenceClassification",
        "SEQ_CLS", "text-classification", causal=False, eval_metrics=("eval_loss",),
        recipe_metrics=True, class_labels=True, data_builder="hf_tune.data.classification:tokenize_classification"),
    # images through the model's image processor, on the fly in the collator (hf_tune.data.images)
    "image_classification": Task(
        "image_classification", "AutoModelForImageClassification", "AutoPeftModel", None, "image-classification",
        causal=False, eval_metrics=("eval_loss",), recipe_metrics=True, class_labels=True,
        processor="AutoImageProcessor", data_builder="hf_tune.data.images:image_examples",
        collator="hf_tune.data.images:ImageClassificationCollator", check_inputs="hf_tune.data.images:sample_images"),
    # vision-language chat: the processor's chat template and image tokens; the model's own loss on the assistant's
    # tokens (hf_tune.data.vision_chat); the vision tower frozen unless model.train_vision_tower
    "image_text_to_text": Task(
        "image_text_to_text", "AutoModelForImageTextToText", "AutoPeftModel", None, "image-text-to-text",
        causal=False, eval_metrics=("eval_loss",), recipe_metrics=False, class_labels=False,
        processor="AutoProcessor", data_builder="hf_tune.data.vision_chat:vision_chat_examples",
        collator="hf_tune.data.vision_chat:VisionChatCollator", vision_language=True,
        check_inputs="hf_tune.data.vision_chat:sample_conversations", merges_by_shard=True),
    # method: reward (hf_tune.catalog.methods): one score per sequence, trained on chosen / rejected pairs
    "reward_model": Task(
        "reward_model", "AutoModelForSequenceClassification", "AutoPeftModelForSequenceClassification", "SEQ_CLS",
        "text-classification", causal=False, eval_metrics=("eval_loss", "eval_accuracy"),
        recipe_metrics=False, class_labels=False, num_labels=1),
}
DEFAULT_TASK = "causal_lm"


def task_of(name: str | None) -> Task:
    """The task by name (a recipe's ``model.task``; None, as in an older run folder's recipe, is the default)."""
    return TASKS[name or DEFAULT_TASK]
