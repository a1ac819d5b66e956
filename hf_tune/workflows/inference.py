"""A finished run (adapter or full model) loaded for inference, and one reply through its chat template
(``hf-tune chat``, ``generate``, ``serve``, the demo)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from hf_tune.errors import HfTuneError
from hf_tune.records.run_reader import load_adapter_run, open_run

DTYPES = ("auto", "bfloat16", "float16", "float32")  # auto: the dtype the checkpoint was saved in


def default_device() -> str:
    """cuda if there is one, else Apple's mps, else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def default_dtype(device: str) -> str:
    """bfloat16 on a GPU that computes in it, else float32 (a CPU's bfloat16 matmuls are slow or emulated)."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if kind == "mps":
        try:
            torch.ones(1, dtype=torch.bfloat16, device="mps")  # macOS 14 and newer
            return "bfloat16"
        except (RuntimeError, TypeError):
            return "float32"
    return "float32"


def load_trained(run_dir: str | Path, device: str | None = None, dtype: str | None = None):
    """(model, tokenizer) from a run folder: a LoRA adapter is loaded onto its base model, a full model as is, in
    ``dtype`` (default: default_dtype of the device) on ``device`` (default: default_device())."""
    run_dir = Path(run_dir)
    device = device or default_device()
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise HfTuneError(f"--device {device}: {str(err).splitlines()[0]}\n  fix: pass --device "
                          f"{default_device()} (or leave --device out to use it)") from None
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise HfTuneError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    run = open_run(run_dir, needs=("tokenizer",)).require_causal_lm("chat and eval talk to")
    if run.weights() == "adapter":
        model = load_adapter_run(run, AutoModelForCausalLM, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(run_dir, **kwargs)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(run_dir)


@torch.no_grad()
def reply(model, tokenizer, messages: list[dict[str, str]], max_new_tokens: int = 128, temperature: float = 0.0,
          top_p: float = 1.0, seed: int | None = None, stream: bool = False) -> str:
    """The model's next assistant turn, decoded without special tokens: greedy at temperature 0, else sampled
    (temperature, nucleus top_p; ``seed`` makes it repeatable). ``stream`` prints the text to stdout as it comes."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise HfTuneError(f"--temperature {temperature} / --top-p {top_p}: need temperature >= 0 (0 = greedy) "
                          "and 0 < top_p <= 1")
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = inputs.to(model.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
        {"do_sample": False}
    if seed is not None:
        torch.manual_seed(seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id, streamer=streamer, **sampling)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
