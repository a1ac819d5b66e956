"""Run under torchrun by test_world_size.py: ``hf_tune.run``'s ``train`` with one more callback, which appends to
``RUN/seen-rank{R}.jsonl``, for each micro-batch this rank trains on, the optimizer step and a hash of each example's
token ids (read by a forward pre-hook on the model, so it sees exactly what the model was given)."""

import hashlib
import json
import sys
from pathlib import Path

from transformers import TrainerCallback

from hf_tune import load_recipe
from hf_tune.commands.command_line import configure_logging
from hf_tune.runtime.distributed import end_process_group
from hf_tune.workflows.train import train


def example_ids(batch) -> list:
    """Token ids of each example in a batch: padded rows (attention mask) or one flattened row (position_ids)."""
    if "attention_mask" in batch and batch["attention_mask"] is not None:
        return [ids[mask.bool()] for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    row, positions = batch["input_ids"][0], batch["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist() + [len(row)]
    return [row[a:b] for a, b in zip(starts, starts[1:])]


class SeenExamples(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.path, self.state = Path(args.output_dir) / f"seen-rank{args.process_index}.jsonl", state
        model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, positional, batch):
        if module.training:
            hashes = [hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] for ids in example_ids(batch)]
            with self.path.open("a") as out:
                out.write(json.dumps({"step": self.state.global_step + 1, "examples": hashes}) + "\n")


configure_logging()
train(load_recipe(sys.argv[1]), callbacks=[SeenExamples()])
end_process_group()
