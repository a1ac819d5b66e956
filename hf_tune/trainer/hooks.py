"""hf_tune's Trainer features as a mixin, extended only through Trainer's own hooks: over ``transformers.Trainer``
(``HfTuneTrainer``, method sft) and over TRL's trainers (the other methods, ``method_trainer_class``). The trainers
are built, and their callbacks attached, in ``hf_tune.assembly.run_build``."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from accelerate.data_loader import IterableDatasetShard
from transformers import Trainer
from typing_extensions import override

from hf_tune.catalog.methods import method_of
from hf_tune.data.streaming import split_by_hf_tune
from hf_tune.errors import HfTuneError
from hf_tune.model.chunked_head import hidden_state_inputs
from hf_tune.model.loss import is_chunked
from hf_tune.optim import layerwise_param_groups, recipe_param_infos
from hf_tune.recipe.schema import OptimSection
from hf_tune.trainer.flat_pairs import FlatPreferenceRows
from hf_tune.trainer.generators import generators_kept
from hf_tune.trainer.monitors import Monitors, monitors_of
from hf_tune.trainer.reference import ReferenceLogpsCache
from hf_tune.trainer.tool_rollouts import ToolRollouts

if TYPE_CHECKING:  # the annotations' classes: the hooks reach them through the trainer's monitors
    from hf_tune.trainer.loss_guard import NonFiniteLossGuard
    from hf_tune.trainer.throughput import Throughput


class HfTuneMixin:
    """hf_tune's features for any ``Trainer`` subclass (placed before it in the bases): the optimizer gets hf_tune's
    parameter groups (decay / no decay, layer-wise LR decay, head LR), a non-finite loss stops training on every rank
    at the next log or save, before any checkpoint holds it (``hf_tune.trainer.loss_guard``), and logs add the LR of the
    lowest and highest group, throughput (tokens/s, MFU, peak memory: ``hf_tune.trainer.throughput``) and, for
    supervised causal LMs, eval perplexity. The NaN guard, the throughput counter and the others the hooks feed are
    callbacks that ``hf_tune.assembly.run_build.attach_callbacks`` attaches and hands to the trainer as its ``monitors``
    (``hf_tune.trainer.monitors``); a trainer without them stops at its first hook with an error saying so.

    The optimizer class and its arguments still come from ``training.optim``, so the groups compose with every
    optimizer Trainer supports. The schedule is upstream's (``cosine_with_min_lr`` by default, see the recipe), which
    scales each group from its own peak.
    """

    def __init__(self, *args, optim: OptimSection | None = None, causal: bool = False,
                 perplexity: bool | None = None, monitors: Monitors | None = None, **kwargs):
        """``causal``: next-token training (the task's); ``perplexity``: eval_loss is a next-token loss, so
        exp(eval_loss) is reported too (default: ``causal``); ``monitors``: what the hooks feed, usually handed over
        by ``attach_callbacks``."""
        self.monitors = monitors
        super().__init__(*args, **kwargs)
        self.optim = optim or OptimSection()
        self.causal = causal
        self.perplexity = causal if perplexity is None else perplexity

    @property
    def throughput(self) -> Throughput | None:
        """The throughput counter the hooks feed (None where the run counts no tokens)."""
        return monitors_of(self).throughput

    @property
    def loss_guard(self) -> NonFiniteLossGuard | None:
        """The NaN guard the hooks feed (None with `Monitors()`)."""
        return monitors_of(self).loss_guard

    @override
    def create_optimizer(self, model=None):
        if self.optimizer is None:  # rebuilt on every train() / search trial: nothing is consumed from the groups
            opt_model = self.model if model is None else model
            infos = recipe_param_infos(opt_model, self.optim, self.args.learning_rate, self.args.weight_decay)
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            if {"params", "model", "optimizer_dict"} & kwargs.keys() or not isinstance(optimizer_cls, type):
                raise HfTuneError(f"training.optim: {self.args.optim} builds its own parameter groups, so hf_tune's "
                                  "groups (optim section) cannot apply\n  fix: use an AdamW/SGD-style optimizer")
            self.optimizer = optimizer_cls(layerwise_param_groups(opt_model, infos), **kwargs)
        return super().create_optimizer(model)

    @override
    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        if split_by_hf_tune(self.train_dataset):  # this rank's share of a stream (hf_tune.data.streaming)
            shard = dataloader.dataset
            if not isinstance(shard, IterableDatasetShard):
                raise HfTuneError("training.accelerator_config: dispatch_batches reads the stream on rank 0 only, but "
                                  "each rank already reads its own share of it\n  fix: leave dispatch_batches out")
            shard.num_processes, shard.process_index = 1, 0  # accelerate would keep one batch in world_size of it
        return dataloader

    @override
    def training_step(self, model, inputs, num_items_in_batch=None):
        skips = monitors_of(self).step_skips  # resilience.rollback_on_nonfinite: this step's batches gave a NaN
        if skips is not None and skips.skips(self.state.global_step + 1):
            return skips.skip(self.state.global_step + 1, inputs, self.args.device)
        throughput = self.throughput
        if throughput is not None and isinstance(inputs, Mapping):
            for counted in counted_batches(inputs):
                throughput.add(counted)
        return super().training_step(model, inputs, num_items_in_batch)

    @override
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        throughput, loss_guard = self.throughput, self.loss_guard
        if throughput is not None and model.training and "completion_ids" in inputs and "input_ids" not in inputs:
            throughput.add(generated_batch(inputs))  # GRPO: the batch is known once its completions are sampled
        if self.compute_loss_func is not None and "skip_logits" in inputs:
            # Trainer's evaluation asks Liger's forward (training.use_liger_kernel) for its own loss and no logits;
            # hf_tune's loss takes the labels from the model's inputs and reads the logits or hidden states itself
            inputs = {key: value for key, value in inputs.items() if key != "skip_logits"}
        if model.training and is_chunked(self.compute_loss_func) and "labels" in inputs:
            # model.chunked_loss: hidden states and no full logits from the forward; the head runs in the loss, under
            # the forward's autocast (accelerate's public context) as the model's own lm_head would
            with self.accelerator.autocast():
                result = super().compute_loss(model, hidden_state_inputs(inputs), return_outputs,
                                              num_items_in_batch)
        else:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if loss_guard is not None and model.training:  # recorded on the device, checked at the next log / save
            loss_guard.add(result[0] if return_outputs else result, self.state.global_step + 1)
        return result

    @override
    def evaluate(self, *args, **kwargs):
        """Upstream's evaluation, with the run's random-number generators kept (``trainer/generators.py``): its data
        loader's iterator, generation samples, downstream tasks (lm-eval seeds every global generator) and the
        callbacks it calls draw from them, so a run evaluated every few steps trains exactly as one that is not."""
        with generators_kept():
            return super().evaluate(*args, **kwargs)

    @override
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Upstream's loop, then the recipe's downstream scores (lm-eval tasks) added to the evaluation's metrics,
        before they are logged and read by the best-model tracking and early stopping."""
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        downstream = monitors_of(self).downstream
        if downstream is not None and metric_key_prefix == "eval":
            model = self.accelerator.unwrap_model(self.model)
            output.metrics.update(downstream.metrics(model, self.processing_class, self.accelerator))
        return output

    @override
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "learning_rate" in logs and self.optimizer is not None:
            # Trainer logs group 0's LR as applied at this step; every group follows the same schedule factor,
            # so the others are that LR times their peak ratio to group 0.
            peaks = [group.get("initial_lr", group["lr"]) for group in self.optimizer.param_groups]
            if peaks[0]:
                logs["lr_min"] = logs["learning_rate"] * min(peaks) / peaks[0]
                logs["lr_max"] = logs["learning_rate"] * max(peaks) / peaks[0]
        throughput = self.throughput
        if throughput is not None and ("loss" in logs or "train_runtime" in logs):  # a training log, or the end
            logs.update(throughput.metrics(self.accelerator, final="train_runtime" in logs))
        if "loss" in logs and hasattr(self.compute_loss_func, "pop_logs"):  # a mixture of experts' router loss
            logs.update(self.compute_loss_func.pop_logs())
        if "eval_loss" in logs and self.perplexity:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 50.0))  # capped: exp overflows past ~709
        super().log(logs, start_time)


def counted_batches(inputs: Mapping) -> list[Mapping]:
    """A training batch as the sequences the model runs, with labels on the trained tokens, for the throughput
    counts: GRPO's and RLOO's batches hold prompts only here (counted once sampled: ``generated_batch``)."""
    if "input_ids" in inputs:
        if "completion_mask" in inputs and "labels" not in inputs:  # TRL's pairs: the completions are trained
            return [{**inputs, "labels": inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)}]
        return [inputs]
    if "chosen_input_ids" in inputs:  # ORPO's and CPO's pairs: each side padded on its own, -100 on the prompt
        return [{"input_ids": inputs[f"{side}_input_ids"], "attention_mask": inputs[f"{side}_attention_mask"],
                 "labels": inputs[f"{side}_labels"]} for side in ("chosen", "rejected")]
    return []


def generated_batch(inputs: Mapping) -> dict[str, torch.Tensor]:
    """A GRPO batch (prompt and sampled completion ids with their masks) as the sequences the model runs, with the
    completion tokens as the trained ones, for the throughput counts."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    trained = torch.cat([torch.zeros_like(inputs["prompt_mask"]), inputs["completion_mask"]], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(trained == 0, -100)}


class HfTuneTrainer(HfTuneMixin, Trainer):
    """``Trainer`` with hf_tune's features (``HfTuneMixin``): the trainer of method sft."""


@functools.cache
def method_trainer_class(name: str) -> type:
    """The trainer class of a method: ``HfTuneTrainer``, or hf_tune's mixins over the method's TRL trainer (with the
    cached reference log-probabilities where the method has a reference model, and its pairs as flattened rows
    where it can run them so)."""
    method = method_of(name)
    if not method.uses_trl:
        return HfTuneTrainer
    upstream = method.trainer
    bases = ((ReferenceLogpsCache,) if method.reference else ()) + ((FlatPreferenceRows,) if method.flat_pairs
                                                                     else ()) + ((ToolRollouts,) if method.tools
                                                                                 else ()) + (HfTuneMixin, upstream)
    return type(f"HfTune{upstream.__name__}", bases, {"__doc__": f"{upstream.__name__} with hf_tune's features."})

