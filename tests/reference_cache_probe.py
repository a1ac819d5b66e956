"""Run under the `deepspeed` launcher by test_reference_cache.py: build the DPO trainer of each recipe in turn (TRL
computes or reuses the reference log-probabilities when the trainer is built), then dump per rank what each got."""

import json
import logging
import os
import sys

import hf_tune.reference
from hf_tune import load_recipe
from hf_tune.build import build_run

logging.basicConfig(level=logging.INFO)

if os.environ.get("PROBE_WITHOUT_FILES"):  # as for a model built in memory: keyed by its gathered weights
    hf_tune.reference.files_identity = lambda model: None
*recipe_paths, report_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
report = []
for path in recipe_paths:
    trainer = build_run(load_recipe(path)).trainer
    data = trainer.train_dataset
    report.append({"hits": getattr(trainer, "reference_cache_hits", 0),
                   "rows": [{key: data[i][key] for key in ("prompt_ids", "chosen_ids", "ref_chosen_logps")}
                            for i in range(len(data))]})
    rank = trainer.args.process_index
    del trainer
with open(f"{report_path}.rank{rank}", "w") as f:
    json.dump(report, f)
