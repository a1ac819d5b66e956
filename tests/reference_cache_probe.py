"""Run under the `deepspeed` launcher by test_reference_cache.py: for each phase (a base identity and a cache folder),
build the DPO trainer of each of its recipes in turn (TRL computes or reuses the reference log-probabilities when the
trainer is built), then dump per rank and phase what each trainer got. Usage: ``probe.py REPORT PHASE...`` with
PHASE = ``IDENTITY,CACHE_DIR,RECIPE[,RECIPE...]``, IDENTITY ``files`` or ``weights`` (as for a model built in memory,
with no weight files: keyed by its weights gathered from the shards). One launch serves every phase."""

import json
import logging
import os
import sys

import hf_tune.trainer.reference
from hf_tune import load_recipe
from hf_tune.assembly.run_build import build_run
from hf_tune.runtime.distributed import end_process_group

logging.basicConfig(level=logging.INFO)


class Messages(logging.Handler):
    """The messages hf_tune.trainer.reference logs on this rank."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


report_path, *phases = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
with_files = hf_tune.trainer.reference.files_identity
report, rank = [], 0
for phase in phases:
    identity, cache, *recipe_paths = phase.split(",")
    os.environ["HF_TUNE_CACHE"] = cache
    hf_tune.trainer.reference.files_identity = with_files if identity == "files" else (lambda model: None)
    messages = Messages()
    logging.getLogger("hf_tune.trainer.reference").addHandler(messages)
    trainers = []
    for path in recipe_paths:
        trainer = build_run(load_recipe(path)).trainer
        data = trainer.train_dataset
        trainers.append({"hits": getattr(trainer, "reference_cache_hits", 0),
                         "rows": [{key: data[i][key] for key in ("prompt_ids", "chosen_ids", "ref_chosen_logps")}
                                  for i in range(len(data))]})
        rank = trainer.args.process_index
        del trainer
    logging.getLogger("hf_tune.trainer.reference").removeHandler(messages)
    report.append({"identity": identity, "trainers": trainers, "messages": messages.messages})
with open(f"{report_path}.rank{rank}", "w") as f:
    json.dump(report, f)
end_process_group()  # the ranks leave together: gloo aborts a rank whose peer closed first (exit -6)
