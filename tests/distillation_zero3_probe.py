"""Run on 2 ZeRO-3 ranks by test_more_methods.py: build a distillation run from a recipe, record how each rank holds
the teacher's weights (DeepSpeed's partitioned parameters: a local shard, ``ds_numel`` the whole), train it, and
write a JSON report per rank.

``distillation_zero3_probe.py RECIPE REPORT``"""

import json
import sys

from hf_tune import load_recipe
from hf_tune.assembly.run_build import build_run
from hf_tune.runtime.distributed import end_process_group

arguments = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
recipe_path, report_path = arguments[:2]
run = build_run(load_recipe(recipe_path))
trainer = run.trainer
teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
held = [(p.ds_numel if hasattr(p, "ds_numel") else p.numel(), p.ds_tensor.numel() if hasattr(p, "ds_tensor") else
         p.numel(), p.requires_grad) for p in teacher.parameters()]
trainer.train()
report = {"rank": trainer.args.process_index, "world": trainer.args.world_size,
          "teacher_numel": sum(whole for whole, _, _ in held), "teacher_local": sum(local for _, local, _ in held),
          "teacher_trainable": sum(trainable for _, _, trainable in held),
          "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
with open(f"{report_path}.{report['rank']}", "w") as f:
    json.dump(report, f)
end_process_group()
