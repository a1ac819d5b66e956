"""Resuming on another number of processes (DDP 2 -> 1, 1 -> 2, ...): the same examples per optimizer step.

What Trainer and accelerate already do, whatever the world size: the sampler is accelerate's
``SeedableRandomSampler`` (one permutation per epoch from ``data_seed`` / ``seed`` and the epoch, the same on every
world size); ``BatchSamplerShard`` deals the batches of ``per_device_train_batch_size`` examples round-robin, batch
``k`` to rank ``k mod W``; one optimizer step takes ``gradient_accumulation_steps`` (G) of them on each rank; a resume
skips ``global_step x G`` batches on each rank. So with the global batch ``per_device x W x G`` unchanged, step ``s``
trains on the global batches ``s*W*G ... (s+1)*W*G - 1`` on any world size, and a resume continues the data order
exactly. Keeping G as it was instead changes the global batch and skips the wrong number of examples (some are seen
twice in the epoch, others never), silently: that is upstream's behaviour.

So each checkpoint records the batch shape it was trained with (``BatchShape``, a Trainer stateful callback: its
entry in ``trainer_state.json``), and ``fit_world_size`` compares it with the resuming launch: it keeps the global
batch by setting ``gradient_accumulation_steps`` (logged), or refuses with the keys to set when it cannot.
What cannot continue exactly on another world size is refused (a streamed dataset: each rank reads its own share of
the files; length-grouped sampling: its groups depend on the batch shape) or logged (the per-rank random-number
states, ``rng_state_N.pth``, that Trainer restores only on the same number of ranks). DeepSpeed ZeRO states,
partitioned by rank, are converted to DeepSpeed's universal checkpoint and loaded from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hf_tune import run_folder
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.runtime.distributed import decided_on_main
from hf_tune.runtime.ds_config import load_deepspeed_config

logger = logging.getLogger(__name__)
ACCUMULATION = "training.gradient_accumulation_steps"


@dataclasses.dataclass(frozen=True)
class Shape:
    """The batch shape of a training launch: processes, examples per micro-batch and rank, micro-batches per step."""

    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.per_device_train_batch_size * self.gradient_accumulation_steps

    @classmethod
    def of(cls, args) -> Shape:
        return cls(args.world_size, args.per_device_train_batch_size, args.gradient_accumulation_steps)

    def __str__(self) -> str:
        return (f"{self.world_size} process(es) x {self.per_device_train_batch_size} per device x "
                f"{self.gradient_accumulation_steps} accumulated = {self.global_batch}")


class BatchShape(TrainerCallback, ExportableState):
    """Records the launch's batch shape in each checkpoint's ``trainer_state.json`` (``stateful_callbacks``)."""

    def __init__(self, world_size: int = 1, per_device_train_batch_size: int = 1, gradient_accumulation_steps: int = 1):
        self.shape = Shape(world_size, per_device_train_batch_size, gradient_accumulation_steps)

    def on_train_begin(self, args, state, control, **kwargs):
        self.shape = Shape.of(args)  # this launch's, also when Trainer rebuilt us from a checkpoint's record

    def state(self) -> dict:
        return {"args": dataclasses.asdict(self.shape), "attributes": {}}


def checkpoint_shape(checkpoint: Path) -> tuple[Shape | None, int]:
    """The batch shape a checkpoint recorded (None if it predates the record), and its number of ranks as its
    per-rank RNG files say (``rng_state.pth`` alone, or ``rng_state_N.pth`` for each of N ranks)."""
    ranks = len(list(checkpoint.glob("rng_state_*.pth"))) or 1
    try:
        state = json.loads((checkpoint / run_folder.TRAINER_STATE).read_text())
        return Shape(**state["stateful_callbacks"][BatchShape.__name__]["args"]), ranks
    except (OSError, ValueError, KeyError, TypeError):
        return None, ranks


def fit_world_size(recipe, args, checkpoint: Path):
    """The recipe to resume ``checkpoint`` with on this launch's world size: unchanged on the checkpoint's world
    size; else with the ``gradient_accumulation_steps`` that keeps the checkpoint's global batch (logged). Raises
    ``RecipeError`` when the resume could not continue the data order exactly."""
    saved, ranks = checkpoint_shape(checkpoint)
    now = Shape.of(args)
    if saved is None:
        if ranks == now.world_size:
            return recipe
        # an older checkpoint: its accumulation is unknown, the recipe's is taken for it
        saved = Shape(ranks, now.per_device_train_batch_size, now.gradient_accumulation_steps)
        logger.warning("%s records no batch shape; assuming it was trained with this recipe's "
                       "per_device_train_batch_size and gradient_accumulation_steps", checkpoint)
    if saved.world_size == now.world_size:
        return recipe
    recipe = load_zero_universal(recipe, args, checkpoint, saved.world_size)
    if args.ignore_data_skip:  # the user restarts the epoch's data order: any batch shape is theirs to choose
        logger.warning("Resuming %s (%s) on %s: training.ignore_data_skip is set, so the data order restarts at "
                       "the beginning of the epoch", checkpoint.name, saved, now)
        return recipe
    refuse_inexact(recipe, args, checkpoint, saved, now)
    accumulation = kept_accumulation(saved, now)
    if accumulation != now.gradient_accumulation_steps:
        logger.warning("Resuming %s, trained on %s, on %d process(es): gradient_accumulation_steps %d -> %d keeps "
                       "the global batch of %d examples and the data order", checkpoint.name, saved,
                       now.world_size, now.gradient_accumulation_steps, accumulation, saved.global_batch)
        recipe = dataclasses.replace(recipe, training={**recipe.training, "gradient_accumulation_steps": accumulation})
    else:
        logger.info("Resuming %s, trained on %s, on %s: the same global batch", checkpoint.name, saved, now)
    logger.warning("Resuming on %d process(es) a checkpoint of %d: Trainer restores per-rank random-number states "
                   "(rng_state_N.pth) only on the same number of ranks, so dropout and other random draws continue "
                   "from this launch's seeding, not from the checkpoint's (the data order does not depend on them)",
                   now.world_size, saved.world_size)
    return recipe


def kept_accumulation(saved: Shape, now: Shape) -> int:
    """The accumulation this launch must use for the checkpoint's global batch; a ``RecipeError`` if none can."""
    if now.global_batch == saved.global_batch:  # the user set it already
        return now.gradient_accumulation_steps
    per_step = now.world_size * now.per_device_train_batch_size
    fits = saved.global_batch % per_step == 0
    if fits and now.gradient_accumulation_steps == saved.gradient_accumulation_steps:
        return saved.global_batch // per_step
    if fits:
        fix = (f"{ACCUMULATION}={saved.global_batch // per_step} (or leave it at the checkpoint's "
               f"{saved.gradient_accumulation_steps} and hf_tune sets it)")
    else:
        fix = (f"choose training.per_device_train_batch_size and {ACCUMULATION} whose product with "
               f"{now.world_size} process(es) is {saved.global_batch}")
        if saved.global_batch % now.per_device_train_batch_size == 0:
            fix = (f"launch a number of processes that divides {saved.global_batch // now.per_device_train_batch_size}"
                   f" (global batch / per_device_train_batch_size), or {fix}")
    raise RecipeError(ACCUMULATION, f"the checkpoint was trained with a global batch of {saved} examples; this "
                      f"launch would train with {now}. Trainer skips the batches already trained by counting this "
                      "launch's batches, so another global batch would repeat some examples of the epoch and skip "
                      "others", fix=f"{fix}; or set training.ignore_data_skip=true to restart the epoch's data order")


def refuse_inexact(recipe, args, checkpoint: Path, saved: Shape, now: Shape) -> None:
    """Refuse what cannot continue its data order on another number of processes."""
    change = f"{checkpoint.name} was trained on {saved.world_size} process(es), this launch has {now.world_size}"
    restart = "or set training.ignore_data_skip=true to restart the epoch's data order"
    if getattr(recipe.data, "streaming", False):
        raise RecipeError("data.streaming", f"{change}: a streamed dataset is split between the ranks by file or by "
                          "example, so another number of ranks reads another order and the position cannot carry over",
                          fix=f"resume on {saved.world_size} process(es), {restart}")
    if args.train_sampling_strategy in ("group_by_length", "batch_rebalance"):
        raise RecipeError("training.train_sampling_strategy", f"{change}: '{args.train_sampling_strategy}' groups "
                          "examples by the batch shape, so another shape draws another order",
                          fix=f"resume on {saved.world_size} process(es), {restart}")


def load_zero_universal(recipe, args, checkpoint: Path, ranks: int):
    """ZeRO partitions the optimizer states (ZeRO-3 the weights too) over the ranks: another number of ranks loads
    them from DeepSpeed's universal checkpoint, converted once next to the checkpoint (on the main process, every
    rank waiting) and loaded with ``"checkpoint": {"load_universal": true}`` added to the recipe's DeepSpeed config."""
    tags = sorted({p.parent.name for p in checkpoint.glob("global_step*/*zero_pp_rank_*optim_states.pt")})
    if not tags or not args.deepspeed:
        return recipe
    latest = checkpoint / "latest"
    tag = latest.read_text().strip() if latest.is_file() else tags[-1]
    if not (checkpoint / "latest_universal").is_file():
        decided_on_main(lambda: convert_to_universal(checkpoint, tag, ranks))
    logger.warning("Resuming %s, whose DeepSpeed ZeRO states are partitioned over %d ranks, from its universal "
                   "checkpoint %s", checkpoint.name, ranks, (checkpoint / "latest_universal").read_text().strip())
    config = load_deepspeed_config(recipe.training["deepspeed"])
    config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    return dataclasses.replace(recipe, training={**recipe.training, "deepspeed": config})


def convert_to_universal(checkpoint: Path, tag: str, ranks: int) -> None:
    argv = universal_argv(checkpoint, tag)
    logger.warning("Converting %s/%s to DeepSpeed's universal checkpoint: %s", checkpoint.name, tag, shlex.join(argv))
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise HfTuneError(f"training.deepspeed: {checkpoint.name} holds DeepSpeed ZeRO states of {ranks} ranks, and "
                          f"converting them to a universal checkpoint failed:\n{done.stderr[-2000:]}\n  fix: resume "
                          f"on {ranks} process(es)")


def universal_argv(checkpoint: Path, tag: str) -> list[str]:
    """DeepSpeed's converter, writing the universal checkpoint next to ``checkpoint/tag`` and ``latest_universal``
    (which DeepSpeed reads when its config loads universal checkpoints). ``--inject_missing_state``: Trainer's engine
    saves no ``universal_checkpoint_info``, without which the converter stops."""
    return [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--inject_missing_state", "--input_folder",
            str(checkpoint / tag), "--output_folder", str(checkpoint / f"{tag}_universal")]
