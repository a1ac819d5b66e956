"""Run under the `deepspeed` launcher by test_qlora.py: train a QLoRA recipe (hf_tune.train: the run folder and
adapter are written), then dump per rank how DeepSpeed holds each 4-bit weight."""

import json
import sys

from hf_tune import load_recipe, train
from hf_tune.runtime.distributed import end_process_group

recipe_path, report_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
trainer = train(load_recipe(recipe_path))
weights = {name: {"full": getattr(p, "ds_numel", p.numel()), "shard": p.ds_tensor.numel() if hasattr(p, "ds_tensor")
                  else None, "class": type(p).__name__, "dtype": str(p.dtype)}
           for name, p in trainer.model_wrapped.module.named_parameters() if type(p).__name__ == "Params4bit"}
report = {"engine": type(trainer.model_wrapped).__name__, "weights": weights,
          "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}
with open(f"{report_path}.rank{trainer.args.process_index}", "w") as f:
    json.dump(report, f)
end_process_group()  # the ranks leave together: gloo aborts a rank whose peer closed first (exit -6)
