"""The schema of a recipe: our own sections as pydantic models, upstream sections checked against upstream types.

Two top-level keys besides the sections: ``method`` (hf_tune.catalog.methods: sft, dpo, grpo, ...), which picks
the trainer and the upstream config class ``training`` is checked against; and ``rewards`` (methods grpo and rloo):
the reward functions, each a shipped name, a ``module:function`` path, or ``{name: ..., <its keyword arguments>}``
(hf_tune.catalog.rewards).

Sections:
  model     -> ``from_pretrained`` arguments plus ``task``                      (ours: ModelSection)
  teacher   -> method distillation's frozen teacher: the same keys as ``model``    (ours: ModelSection)
  lora      -> ``peft.LoraConfig`` keyword arguments, verbatim; absent = full fine-tune
  data      -> ``datasets.load_dataset`` arguments plus format / rendering keys   (ours: DataSection)
  training  -> ``transformers.TrainingArguments`` keyword arguments, verbatim (or the method's TRL config class)
  optim     -> parameter groups (decay / no decay, layer-wise LR decay) and the schedule floor (ours: OptimSection)
  evaluation-> metrics and early stopping                                      (ours: EvaluationSection)
  hub       -> model-card metadata                                             (ours: HubSection)
  search    -> hyperparameter search space and study settings     (ours: SearchSection, in recipe/search_section.py)
  tracking  -> project / run name / group / tags for the trackers in training.report_to (ours: TrackingSection)
  profile   -> torch.profiler over a few training steps: wait / warmup / active      (ours: ProfileSection)
  machine   -> the machine the recipe was written for: world size and GPU memory (ours: MachineSection; `plan`
               uses them unless told otherwise, `init` writes them)
  resilience-> checkpoints mirrored to object storage, roll back on a non-finite loss (ours: ResilienceSection, in
               recipe/resilience_section.py)
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, PositiveFloat, PositiveInt, Tag, model_validator

from hf_tune.catalog.formats import DEFAULT_FORMAT, FORMATS
from hf_tune.catalog.methods import DEFAULT_METHOD, METHODS
from hf_tune.catalog.tasks import DEFAULT_TASK, TASKS
from hf_tune.recipe.agent_section import AgentSection
from hf_tune.recipe.resilience_section import ResilienceSection
from hf_tune.recipe.run_sections import MachineSection, ProfileSection
from hf_tune.recipe.search_section import Distribution, SearchSection  # noqa: F401  re-exported for their importers
from hf_tune.recipe.section import Section as _Section

METHOD_DEFAULTS = ", ".join(  # "preference for dpo and reward, ...": the formats the other methods read first
    f"{name} for {' and '.join(m.name for m in METHODS.values() if m.formats[0] == name)}" for name in FORMATS
    if name != DEFAULT_FORMAT and any(m.formats[0] == name for m in METHODS.values()))


class ModelSection(_Section):
    """What ``AutoModel*.from_pretrained`` gets (upstream names), plus the task head."""

    pretrained_model_name_or_path: str = Field(
        description="Hub id, local folder, or an embedded model: embedded:SmolLM2-135M-Instruct, "
                    "embedded:all-MiniLM-L6-v2"
    )
    task: Literal[tuple(TASKS)] = Field(  # the table's names: hf_tune.catalog.tasks
        default=DEFAULT_TASK, description="the model head; default: the method's (reward_model for method: reward)")
    revision: str | None = None
    gguf_file: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    attn_implementation: str | None = Field(
        default=None, description="from_pretrained's: eager | sdpa | flash_attention_2 | ..., or hf_tune's sdpa_varlen "
                                  "(default for causal LMs on transformers' attention interface: SDPA that runs each "
                                  "example of a flattened row apart, so packs need no padding; "
                                  "hf_tune.model.attention)")
    trust_remote_code: bool = False
    num_labels: PositiveInt | None = None
    ignore_mismatched_sizes: bool | None = Field(
        default=None, description="from_pretrained's: a classification head of another width (a 1000-class ImageNet "
                                  "head, new classes) is drawn afresh instead of refused")
    train_vision_tower: bool = Field(
        default=False, description="task image_text_to_text: the vision tower and its projector train too (LoRA "
                                   "adapts them, a full fine-tune updates them); default: only the language model")
    logits_to_keep: Literal["trained", "all"] = Field(
        default="trained", description="causal LM training: project onto the vocabulary only the positions whose next "
                                       "token is trained (same loss, less compute and memory), or all positions")
    chunked_loss: bool | None = Field(
        default=None, description="sft causal LM training: the loss from the last hidden state and the LM head a "
                                  "chunk of positions at a time, so no [tokens, vocabulary] logits are kept (same "
                                  "loss; hf_tune.model.chunked_logprobs); proven on the model before training. Unset: "
                                  "on where that proof passes and the head is frozen (LoRA: the hidden states' "
                                  "gradient is computed in forward), else off with a log line; true: required (a "
                                  "trained head's logits are recomputed in backward); false: off")
    fast_lora_dropout: bool = Field(
        default=True, description="LoRA dropout masks from 16 random bits per element on CPU (hf_tune.model.dropout: "
                                  "same dropout, p rounded to 1/65536; faster than nn.Dropout on CPU, see "
                                  "docs/speed.md); false keeps PEFT's nn.Dropout")
    quantization_config: dict[str, Any] | None = Field(
        default=None, description="transformers.BitsAndBytesConfig arguments, verbatim: load_in_4bit "
                                  "(bnb_4bit_quant_type nf4 | fp4, bnb_4bit_use_double_quant, bnb_4bit_compute_dtype) "
                                  "or load_in_8bit; needs a lora section (QLoRA; hf_tune.model.quantization)")
    router_aux_loss_coef: float | None = Field(
        default=None, ge=0, description="a mixture of experts (SFT): the router's load-balancing loss coefficient "
                                        "(the config's key); default: the config's own, 0 turns the loss off "
                                        "(hf_tune.model.loss.RouterBalancedLoss; logged as router_aux_loss)")
    device_map: str | dict[str, int | str] | None = Field(
        default=None, description="from_pretrained's: auto | cpu | cuda:0 | {module: device}")
    cache_dir: str | None = Field(default=None, description="from_pretrained's: the Hub cache folder to use")
    subfolder: str | None = Field(default=None, description="from_pretrained's: the model's folder inside the repo")


class DatasetSource(_Section):
    """Arguments of ``datasets.load_dataset`` (upstream names). ``path`` may also be a local
    .jsonl/.json/.csv/.parquet/.txt file."""

    path: str
    name: str | None = None
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    data_dir: str | None = None
    split: str = Field(default="train", description="a split, or a slice of one: train[:10%], train[100:200]")
    revision: str | None = None
    columns: dict[str, str] | None = Field(
        default=None, description="the format's column -> this dataset's column, e.g. {messages: conversation}")
    format: str | None = Field(default=None, description="this source's format where a mixture's sources differ; "
                                                         "default: data.format")
    weight: PositiveFloat | None = Field(
        default=None, description="data.train list: how often this source is drawn (interleave_datasets "
                                  "probabilities, normalized over the sources)")
    epochs: PositiveFloat | None = Field(
        default=None, description="data.train: passes over this source (0.5: a seeded half, 2: each example twice)")

    @model_validator(mode="before")
    @classmethod
    def _a_bare_path(cls, value: Any) -> Any:
        """A string is a source's ``path``: ``data.train=my.jsonl`` as TRL's and LLaMA-Factory's users write a dataset
        (a list of strings, a mixture of them)."""
        return {"path": value} if isinstance(value, str) else value


class DataSection(_Section):
    """Where the examples come from and how they become tokens."""

    train: Annotated[Union[Annotated[DatasetSource, Tag("source")], Annotated[list[DatasetSource], Tag("sources")]],
                     Discriminator(lambda v: "sources" if isinstance(v, list) else "source")] = Field(
        description="one source, or a mixture: a list of sources, each with its own format, columns, and weight or "
                    "epochs (hf_tune.data.mixture)")
    eval: DatasetSource | None = None
    eval_split: float | None = Field(default=None, gt=0, lt=1, description="fraction of train held out for eval")
    format: Literal[tuple(FORMATS)] = Field(  # the table's names: hf_tune.catalog.formats
        default=DEFAULT_FORMAT, description=f"how the examples read; default: {DEFAULT_FORMAT}, or the method's "
                                            f"({METHOD_DEFAULTS})")

    max_length: PositiveInt = 1024
    chat_template: str | None = Field(
        default=None, description="Jinja template text or a path to a .jinja file; default: the tokenizer's own"
    )
    tools: str | list[dict[str, Any]] | None = Field(
        default=None, description="chat: tool schemas offered to the chat template in every example without its own "
                                  "'tools' column: a list, or a .json file holding one (hf_tune.data.messages)")
    num_proc: PositiveInt | None = Field(default=None, description="processes for tokenization")
    padding_free: bool | None = Field(
        default=None, description="causal LM: concatenate a batch into one row with restarting position_ids (no pad "
                                  "tokens, no attention across examples); default: on where the model supports it")
    batch_tokens: PositiveInt | None = Field(
        default=None, description="causal LM: pack whole examples, grouped by length, into samples of at most this "
                                  "many tokens; per_device_train_batch_size then counts packs (default 1)")

    stopping_strategy: Literal["first_exhausted", "all_exhausted", "all_exhausted_without_replacement"] = Field(
        default="first_exhausted", description="a mixture with weights: interleave_datasets' stopping_strategy")
    streaming: bool = Field(
        default=False, description="read data.train as an IterableDataset, tokenized and packed on the fly "
                                   "(load_dataset's streaming; needs training.max_steps; hf_tune.data.streaming)")

    @property
    def train_sources(self) -> list[tuple[str, DatasetSource]]:
        """(recipe key, source) of each training source: ``data.train``, or ``data.train[i]`` of a mixture."""
        if isinstance(self.train, list):
            return [(f"data.train[{i}]", source) for i, source in enumerate(self.train)]
        return [("data.train", self.train)]

    @model_validator(mode="after")
    def _one_eval_source(self) -> "DataSection":
        if self.eval is not None and self.eval_split is not None:
            raise ValueError("set either data.eval (a file or split) or data.eval_split (a fraction of train), "
                             "not both")
        return self


class OptimSection(_Section):
    """Optimizer groups and LR schedule (our keys). The optimizer class still comes from ``training.optim``."""

    layerwise_lr_decay: float = Field(default=1.0, gt=0, le=1,
                                      description="LR x decay per layer below the top; 1 = off")
    head_lr: PositiveFloat | None = Field(default=None, description="LR of everything after the last block")
    no_decay: list[str] | None = Field(
        default=None, description="regexes of parameter names without weight decay; default: biases, norms, embeddings")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1,
                                description="floor of the cosine schedule, x each group's peak")
    loraplus_lr_ratio: PositiveFloat | None = Field(
        default=None, description="LoRA+: the LR of LoRA B matrices x this ratio (the paper suggests 16), on top of "
                                  "their depth's LR; needs a lora section")


class EvaluationSection(_Section):
    """Metrics computed at each evaluation, and early stopping (``EarlyStoppingCallback`` arguments)."""

    metrics: list[str] = Field(default_factory=list,
                               description="accuracy, f1 (macro), or a path to an evaluate module")
    early_stopping_patience: PositiveInt | None = None
    early_stopping_threshold: float = Field(default=0.0, ge=0)
    tasks: list[str] = Field(default_factory=list, description=(
        "lm-evaluation-harness tasks scored on the model at each evaluation, logged as eval_<task>_<metric>: lm-eval "
        "task names, hf_tune's shipped hf_tune_arithmetic, hf_tune_chat_skills or hf_tune_persona (offline), or "
        "paths to lm-eval task YAMLs"))
    limit: PositiveFloat | None = Field(default=None,
                                        description="lm-eval's limit: examples per task (a fraction if < 1)")
    num_fewshot: int | None = Field(default=None, ge=0, description="lm-eval's num_fewshot (default: the task's)")
    batch_size: PositiveInt = Field(default=8, description="lm-eval's batch size")
    apply_chat_template: bool = Field(default=False, description=(
        "lm-eval's apply_chat_template: each task's prompt asked as a user turn through the tokenizer's chat template "
        "(hf_tune_chat_skills and hf_tune_persona need it: they ask in the demo chats' format)"))
    samples: list[str] = Field(default_factory=list, description=(
        "prompts generated greedily at each evaluation into samples.jsonl and the trackers (chat template applied)"))
    sample_max_new_tokens: PositiveInt = Field(default=64, description="tokens generated per sample prompt")


class HubSection(_Section):
    """Model-card metadata for ``hf-tune push`` (``training.push_to_hub`` is refused: it would upload the whole run
    folder)."""

    license: str | None = Field(default=None, description="e.g. apache-2.0; default: the base model's, where known")
    tags: list[str] = Field(default_factory=list, description="extra tags; hf_tune and lora are added")


class TrackingSection(_Section):
    """Run identity for the trackers named in ``training.report_to`` (wandb, mlflow, trackio, tensorboard): name and
    project also become Trainer's ``run_name`` / ``project`` unless ``training`` sets them
    (hf_tune.records.tracking)."""

    project: str | None = None
    name: str | None = Field(default=None, description="the run's name (default: Trainer's run_name)")
    group: str | None = None
    tags: list[str] = Field(default_factory=list)


SECTIONS = ("method", "rewards", "agent", "model", "teacher", "lora", "data", "training", "optim", "evaluation", "hub",
            "search", "tracking", "profile", "resilience", "machine")


@dataclasses.dataclass
class Recipe:
    """A validated recipe. ``training`` and ``lora`` hold upstream keyword arguments, verbatim."""

    model: ModelSection
    data: DataSection
    training: dict[str, Any]
    lora: dict[str, Any] | None = None
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    evaluation: EvaluationSection = dataclasses.field(default_factory=EvaluationSection)
    hub: HubSection = dataclasses.field(default_factory=HubSection)
    search: SearchSection | None = None
    tracking: TrackingSection = dataclasses.field(default_factory=TrackingSection)
    profile: ProfileSection | None = None
    resilience: ResilienceSection = dataclasses.field(default_factory=ResilienceSection)
    machine: MachineSection | None = None
    method: str = DEFAULT_METHOD
    rewards: list[str | dict[str, Any]] = dataclasses.field(default_factory=list)
    agent: AgentSection | None = None
    teacher: ModelSection | None = None
    source: Path | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self.training["output_dir"])

    def _data_dict(self) -> dict[str, Any]:
        data = self.data.model_dump(exclude_none=True)
        if METHODS[self.method].uses_trl:  # TRL's trainers have their own length limit: training.max_length
            data.pop("max_length", None)
        return data

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what ``hf-tune validate`` prints and each run folder keeps)."""
        resolved = {
            "method": self.method,
            "rewards": copy.deepcopy(self.rewards) or None,
            "agent": self.agent.model_dump(exclude_none=True) if self.agent else None,
            "model": self.model.model_dump(exclude_none=True),
            "teacher": self.teacher.model_dump(exclude_none=True) if self.teacher else None,
            "lora": copy.deepcopy(self.lora),
            "data": self._data_dict(),
            "training": copy.deepcopy(self.training),
            "optim": self.optim.model_dump(exclude_none=True),
            "evaluation": self.evaluation.model_dump(exclude_none=True),
            "hub": self.hub.model_dump(exclude_none=True),
            "search": self.search.model_dump(exclude_none=True) if self.search else None,
            "tracking": self.tracking.model_dump(exclude_none=True),
            "profile": self.profile.model_dump() if self.profile else None,
            "resilience": self.resilience.model_dump(exclude_defaults=True) or None,  # only when it asks for something
            "machine": self.machine.model_dump(exclude_none=True) if self.machine else None,
        }
        return {k: v for k, v in resolved.items() if v is not None}
