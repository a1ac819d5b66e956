"""The method table: what each recipe ``method`` trains, with which upstream config and trainer, on which data.

``sft`` is hf_tune's own path (``HfTuneTrainer`` on ``TrainingArguments``); the others run TRL's maintained trainers
with hf_tune's Trainer features mixed in (``hf_tune.trainer.hooks.HfTuneMixin``). A new method is one entry here plus,
where its data has a new shape, a format in ``hf_tune.catalog.formats`` (each method names the formats it reads, its
default first). Pure: nothing heavy is imported until a class is asked for.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from hf_tune.catalog.formats import FORMATS
from hf_tune.catalog.late_bound import resolve
from hf_tune.errors import HfTuneError

DEFAULT_METHOD = "sft"


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    # "module:Class" of its TrainingArguments (sub)class: the recipe's `training` is checked against it
    config_class: str
    trainer_class: str | None  # "module:Class" of the upstream trainer hf_tune's mixin goes over; None: HfTuneTrainer
    tasks: tuple[str, ...]  # the model.task values it trains (hf_tune.catalog.tasks); the first is the default
    summary: str  # one line for the README's method table, `plan` and the model card
    eval_metrics: tuple[str, ...] = ()  # what its evaluation reports (a search can optimise them); sft: the task's
    reference: bool = False  # compares against a frozen reference model (the base with the adapter disabled)
    generates: bool = False  # samples completions while training (GRPO, RLOO, on-policy distillation)
    rewarded: bool = False  # its completions are scored by the recipe's reward functions (``rewards``)
    teacher: bool = False  # learns from a frozen teacher model (the recipe's ``teacher`` section)
    config_fixed: tuple[tuple[str, Any], ...] = ()  # config values that make the method (simpo: CPO's loss_type)
    config_defaults: tuple[tuple[str, Any], ...] = ()  # config defaults it sets where the recipe is silent
    spelled: str = ""  # its name as its paper spells it (the model card), where not the name in capitals
    formats: tuple[str, ...] = ()  # the data.format values it reads (hf_tune.catalog.formats), its default first
    unpaired_formats: tuple[str, ...] = ()  # formats it reads as unpaired examples (TRL's unpair_preference_dataset)
    flat_pairs: bool = False  # its padded pairs can run as one flattened row (hf_tune.model.flat_pairs)
    tools: bool = False  # its rollouts call the agent section's tools (TRL's tools, environment_factory)

    @property
    def config(self) -> type:
        return _resolve(self.config_class)

    @property
    def trainer(self) -> type | None:
        return _resolve(self.trainer_class) if self.trainer_class else None

    @property
    def title(self) -> str:
        return self.spelled or self.name.upper()

    @property
    def uses_trl(self) -> bool:
        return self.trainer_class is not None


# sft reads every format a task of its trains on (each format states its tasks once: Format.tasks), in the format
# table's order, chat first (the default)
_SFT_TASKS = ("causal_lm", "sequence_classification", "image_classification", "image_text_to_text")
FORMATS_TRAINED_BY_SFT = tuple(name for name, fmt in FORMATS.items() if set(fmt.tasks) & set(_SFT_TASKS))

METHODS = {
    "sft": Method("sft", "transformers:TrainingArguments", None, _SFT_TASKS,
                  "supervised fine-tuning (or classification): next-token loss on the trained tokens",
                  formats=FORMATS_TRAINED_BY_SFT),
    "dpo": Method("dpo", "trl:DPOConfig", "trl:DPOTrainer", ("causal_lm",),
                  "direct preference optimization on chosen / rejected pairs", reference=True, formats=("preference",),
                  flat_pairs=True,
                  eval_metrics=("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins")),
    "kto": Method("kto", "trl:KTOConfig", "trl:KTOTrainer", ("causal_lm",),
                  "Kahneman-Tversky optimization on completions labelled desirable or not", reference=True,
                  formats=("unpaired_preference", "preference"), unpaired_formats=("preference",),
                  eval_metrics=("eval_loss",)),
    "reward": Method("reward", "trl:RewardConfig", "trl:RewardTrainer", ("reward_model",),
                     "a reward model: one score per sequence, trained with the pairwise loss on chosen / rejected",
                     formats=("preference",),
                     eval_metrics=("eval_loss", "eval_accuracy", "eval_margin")),
    "grpo": Method("grpo", "trl:GRPOConfig", "trl:GRPOTrainer", ("causal_lm",),
                   "group relative policy optimization: sampled completions scored by reward functions",
                   generates=True, rewarded=True, eval_metrics=("eval_loss", "eval_reward"), formats=("prompt_only",),
                   tools=True),
    "rloo": Method("rloo", "trl:RLOOConfig", "trl:RLOOTrainer", ("causal_lm",),
                   "REINFORCE leave-one-out: sampled completions scored by reward functions, each against the mean "
                   "of its group's others", generates=True, rewarded=True, eval_metrics=("eval_loss", "eval_reward"),
                   formats=("prompt_only",)),
    "orpo": Method("orpo", "trl.experimental.orpo:ORPOConfig", "trl.experimental.orpo:ORPOTrainer", ("causal_lm",),
                   "odds ratio preference optimization: next-token loss on chosen plus an odds-ratio term, no "
                   "reference model", eval_metrics=("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"),
                   formats=("preference",)),
    "simpo": Method("simpo", "trl.experimental.cpo:CPOConfig", "trl.experimental.cpo:CPOTrainer", ("causal_lm",),
                    "simple preference optimization: a margin between length-normalised log-probabilities of chosen "
                    "and rejected, no reference model (TRL's CPO with loss_type simpo)",
                    eval_metrics=("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"),
                    config_fixed=(("loss_type", "simpo"),),
                    config_defaults=(("cpo_alpha", 0.0),),  # SimPO alone; cpo_alpha > 0 adds CPO's NLL term
                    spelled="SimPO", formats=("preference",)),
    "distillation": Method("distillation", "trl:DistillationConfig", "trl:DistillationTrainer", ("causal_lm",),
                           "on-policy distillation: the student's sampled completions matched to a teacher's "
                           "next-token distribution (generalised JSD)", generates=True, teacher=True,
                           eval_metrics=("eval_loss",), formats=("prompt_only",)),
}


def method_of(name: str | None) -> Method:
    """The method by name (None, as in a run folder written before methods existed, is ``sft``)."""
    return METHODS[name or DEFAULT_METHOD]


def _resolve(dotted: str) -> type:
    with warnings.catch_warnings():  # ORPO and CPO live in trl.experimental: tested at the TRL of constraints.txt
        warnings.filterwarnings("ignore", message="You are importing from 'trl.experimental'")
        try:
            return resolve(dotted)
        except (ImportError, AttributeError) as err:  # an experimental trainer moved or went in a TRL release
            from importlib.metadata import version


            raise HfTuneError(f"{dotted} is not in the installed TRL {version('trl')} ({err})\n  fix: install the "
                              "TRL hf_tune was tested with: pip install 'trl==1.16.*'") from err
