"""A resumed run trains with the recipe's learning rates and weight decay, not the checkpoint's.

Loading a checkpoint restores the optimizer's groups and the scheduler's peaks as they were saved. When the recipe
changed them since (a lower ``training.learning_rate`` to continue, a PBT mutation), upstream would silently keep
the saved ones. Here each group gets the peak and decay hf_tune's groups give it under the current recipe, and its
current rate follows the schedule at the resumed step. An unchanged recipe changes nothing, so a plain resume stays
bit-exact.
"""

from __future__ import annotations

import logging
import weakref

from transformers import TrainerCallback

from hf_tune.optim import layerwise_param_groups, recipe_param_infos

logger = logging.getLogger(__name__)


class RecipeHyperparameters(TrainerCallback):
    """Re-applies the recipe's group peaks and weight decay after a checkpoint is loaded (``on_train_begin``), from
    the trainer's optim section as it is then (a search trial sets its own). The trainer is held weakly: it holds
    this callback, and a cycle would keep each search trial's model alive until the garbage collector runs."""

    def __init__(self, trainer):
        self.trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step == 0 or optimizer is None:  # nothing was loaded
            return
        fresh = layerwise_param_groups(model, recipe_param_infos(model, self.trainer().optim, args.learning_rate,
                                                                 args.weight_decay))
        groups = optimizer.param_groups
        changed = [(old, new) for old, new in zip(groups, fresh)
                   if (old.get("initial_lr", old["lr"]), old["weight_decay"]) != (new["lr"], new["weight_decay"])]
        if not changed:
            return
        if len(fresh) != len(groups) or not hasattr(lr_scheduler, "lr_lambdas"):
            logger.warning("resume: the optimizer keeps the checkpoint's learning rates and weight decay (%d groups "
                           "there, %d in the recipe; scheduler %s)", len(groups), len(fresh),
                           type(lr_scheduler).__name__)
            return
        old, new = changed[0]
        logger.warning("resume: the recipe's learning rates and weight decay replace the checkpoint's in %d of %d "
                       "optimizer groups (first: peak %g -> %g, weight decay %g -> %g)", len(changed), len(groups),
                       old.get("initial_lr", old["lr"]), new["lr"], old["weight_decay"], new["weight_decay"])
        for index, (group, new) in enumerate(zip(groups, fresh)):
            group["initial_lr"] = lr_scheduler.base_lrs[index] = new["lr"]
            group["weight_decay"] = new["weight_decay"]
            group["lr"] = new["lr"] * lr_scheduler.lr_lambdas[index](lr_scheduler.last_epoch)
        lr_scheduler._last_lr = [group["lr"] for group in groups]
