"""Load a finished run (adapter or full model) and talk to it through its chat template."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_tune import run_folder
from hf_tune.errors import HfTuneError


def load_trained(run_dir: str | Path):
    """(model, tokenizer) from a run folder: a LoRA adapter is loaded onto its base model, a full model as is."""
    run_dir = Path(run_dir)
    if (run_dir / run_folder.ADAPTER_CONFIG).is_file():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(run_dir)
    elif (run_dir / run_folder.MODEL_CONFIG).is_file():
        model = AutoModelForCausalLM.from_pretrained(run_dir)
    else:
        raise HfTuneError(f"{run_dir}: no adapter_config.json or config.json here\n  fix: pass a finished run folder "
                          "(the training.output_dir of a run)")
    return model.eval(), AutoTokenizer.from_pretrained(run_dir)


@torch.no_grad()
def reply(model, tokenizer, messages: list[dict[str, str]], max_new_tokens: int = 128) -> str:
    """The model's next assistant turn (greedy), decoded without special tokens."""
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
