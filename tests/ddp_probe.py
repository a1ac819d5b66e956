"""Run under torchrun / accelerate by test_distributed.py: train from a recipe and write, per rank, the world size,
a hash of every example this rank draws in an epoch, and a checksum of the final parameters (or the error that
stopped training on this rank)."""

import hashlib
import json
import sys
from pathlib import Path

import torch

from hf_tune import build_datasets, build_model_and_tokenizer, build_trainer, build_training_arguments, load_recipe
from hf_tune.errors import HfTuneError
from hf_tune.runtime.distributed import check_distributed, end_process_group

recipe = load_recipe(sys.argv[1])
args = build_training_arguments(recipe)
check_distributed(args)
model, tokenizer = build_model_and_tokenizer(recipe)
train_dataset, _ = build_datasets(recipe, tokenizer, args)
trainer = build_trainer(recipe, model, tokenizer, train_dataset, None, args)


def examples(batch):
    """Token ids of each example in a batch: padded rows (attention mask) or one flattened row (position_ids)."""
    if "attention_mask" in batch:
        return [ids[mask.bool()] for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    row, positions = batch["input_ids"][0], batch["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist() + [len(row)]
    return [row[a:b] for a, b in zip(starts, starts[1:])]


seen = []
for batch in trainer.get_train_dataloader():  # the rank's shard, as Trainer draws it
    seen += [hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] for ids in examples(batch)]
out = Path(args.output_dir) / f"rank{args.process_index}.json"
try:
    trainer.train()
except HfTuneError as err:
    out.write_text(json.dumps({"rank": args.process_index, "error": str(err)}))
    end_process_group()
    sys.exit(0)
digest = hashlib.sha256()
for _, p in sorted(trainer.model.named_parameters()):
    digest.update(p.detach().to(torch.float32).numpy().tobytes())
out.write_text(json.dumps({"world_size": args.world_size, "rank": args.process_index, "examples": seen,
                           "params_sha256": digest.hexdigest()}))
end_process_group()  # the ranks leave together: gloo aborts a rank whose peer closed first (exit -6)
