"""Run on DeepSpeed ranks (torchrun or the `deepspeed` launcher) by test_optim.py / test_deepspeed.py: train from a
recipe, then dump (per rank) the param groups that the DeepSpeed engine's optimizer actually steps and how each
parameter is stored.

``deepspeed_probe.py RECIPE REPORT``: the trainer built by hf_tune's notebook API and trained by ``trainer.train``;
``deepspeed_probe.py RECIPE REPORT whole-run``: the whole run as ``python -m hf_tune.run RECIPE`` does it (its logging,
run folder, final save), so that one launch serves as a test's reference run and as its probe."""

import json
import sys

from hf_tune import build_datasets, build_model_and_tokenizer, build_trainer, build_training_arguments, load_recipe
from hf_tune.runtime.distributed import end_process_group

arguments = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
recipe_path, report_path = arguments[:2]
recipe = load_recipe(recipe_path)
args = build_training_arguments(recipe)
if "whole-run" in arguments[2:]:  # a word, not a flag: torchrun reads "--run" as its own --run-path
    from hf_tune.commands.command_line import configure_logging
    from hf_tune.workflows.train import train

    configure_logging()
    trainer = train(recipe)
else:
    model, tokenizer = build_model_and_tokenizer(recipe)
    train_dataset, _ = build_datasets(recipe, tokenizer, args)
    trainer = build_trainer(recipe, model, tokenizer, train_dataset, None, args)
    trainer.train()
engine_optimizer = trainer.model_wrapped.optimizer
stepped = getattr(engine_optimizer, "optimizer", engine_optimizer)  # the optimizer inside ZeRO's wrapper
groups = [{"initial_lr": g["initial_lr"], "weight_decay": g["weight_decay"],
           "numel": sum(p.numel() for p in g["params"])} for g in stepped.param_groups]
if hasattr(engine_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3 swaps each group's flat fp32 shard in only
    for group in groups:                                       # while stepping it: count the shards themselves
        group["numel"] = 0
    for sub_group, flat in enumerate(engine_optimizer.fp32_partitioned_groups_flat):
        groups[engine_optimizer.sub_group_to_group_id[sub_group]]["numel"] += flat.numel()
report = {
    "rank": args.process_index,
    "world_size": args.world_size,
    "deepspeed": trainer.is_deepspeed_enabled,
    "engine": type(trainer.model_wrapped).__name__,
    "wrapper": type(engine_optimizer).__name__,
    "groups": groups,
    # ZeRO-3: each rank holds a shard (ds_tensor) of every parameter; the module's own tensor is left empty
    "params": {name: {"full": getattr(p, "ds_numel", p.numel()), "local": p.numel(),
                      "shard": p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None}
               for name, p in trainer.model_wrapped.module.named_parameters()},
}
suffix = f".rank{args.process_index}" if args.world_size > 1 else ""
with open(report_path + suffix, "w") as f:
    json.dump(report, f)
end_process_group()  # the ranks leave together: gloo aborts a rank whose peer closed first (exit -6)
