"""Run by test_gpu_fsdp.py under ``accelerate launch --config_file examples/launch/fsdp2.yaml``: train a LoRA recipe
as ``hf_tune.train`` does (resume from the newest complete checkpoint, train, save the adapter), and write the live
LoRA tensors, gathered whole from the FSDP2 shards, when training begins (after a resume has loaded them) and when it
ends (what the checkpoint and the final save must hold): OUTPUT_DIR/live-begin.pt and live-end.pt."""

import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from hf_tune import load_recipe
from hf_tune.assembly.run_build import build_run
from hf_tune.trainer.checkpoints import resume_checkpoint
from hf_tune.training_args import build_training_arguments
from hf_tune.workflows.train import save_final_model

recipe = load_recipe(sys.argv[1])
args = build_training_arguments(recipe)
run = build_run(recipe, args)
trainer = run.trainer


def dump(tag: str) -> None:
    """Every rank joins the gather; rank 0 writes the LoRA tensors with PEFT's adapter name removed."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if trainer.accelerator.is_main_process:
        lora = {name.replace(".default.", "."): value.detach().float().cpu()
                for name, value in state.items() if "lora_" in name}
        torch.save(lora, Path(args.output_dir) / f"live-{tag}.pt")


class DumpAdapter(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        dump("begin")

    def on_train_end(self, args, state, control, **kwargs):
        dump("end")


trainer.add_callback(DumpAdapter())
trainer.train(resume_from_checkpoint=resume_checkpoint(Path(args.output_dir), "auto"))
save_final_model(trainer)  # as hf_tune.train ends: the whole adapter, gathered from the shards
