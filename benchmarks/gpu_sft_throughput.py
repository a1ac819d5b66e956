"""GPU SFT throughput: hf_tune's GPU defaults against TRL's fastest setup and TRL + Liger, side by side in one run.

    python benchmarks/gpu_sft_throughput.py                          # needs a CUDA GPU; ~0.5B model, 2,000 chats
    python benchmarks/gpu_sft_throughput.py --layers 4 --examples 400    # a quick look

One randomly initialised Llama built from a config (nothing is downloaded: hidden 1,536, 18 layers, GQA 12/4 heads,
about 0.53B parameters with the defaults) with SmolLM2's tokenizer and chat template, loaded in bf16. Every setup
trains the same LoRA (r=16, all linear layers) with bf16 autocast, the same learning rate and seed, about 8,192
tokens per step and no activation checkpointing, for one epoch over the same chats (sft_throughput.py's: Python
standard-library docstrings), each in its own process, one after the other:

- hf_tune: its defaults on a GPU (bf16, the attention build_model chooses: flash attention where installed, else
  sdpa_varlen; token-budget packs of whole chats, padding-free, LM head on trained positions only);
- trl_fastest: TRL's SFTTrainer with packing (bfd) + padding_free, rows of 1,024, on flash attention where
  installed, else SDPA;
- trl_liger: the same with use_liger_kernel (Liger's fused linear cross-entropy, RMSNorm, RoPE, SwiGLU);
- hf_tune_unchunked / hf_tune_chunked: hf_tune with ``model.chunked_loss`` off / on, whatever the default;
- hf_tune_liger: hf_tune with ``training.use_liger_kernel`` (Liger's layer kernels; the loss stays hf_tune's).

Reported: real tokens per second over the epoch (counted by hf_tune's tokenization of the same chats, so every setup
divides the same number) and its ratio to hf_tune, peak GPU memory, mean training loss, MFU
(hf_tune.trainer.throughput's FLOP count over the card's data-sheet bf16 peak) and the attention each setup ran. The
table goes to stdout and to --out; copy it into benchmarks/RESULTS.md with the card's name.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from sft_throughput import LORA, needed_flops, write_data  # noqa: E402  (the CPU benchmark's data and FLOPs)

TOKENIZER = "embedded:SmolLM2-135M-Instruct"
MAX_LENGTH, TOKENS_PER_STEP = 1024, 8192
TRAINING = {"learning_rate": 2.0e-4, "num_train_epochs": 1, "lr_scheduler_type": "cosine", "warmup_steps": 0.1,
            "weight_decay": 0.0, "logging_steps": 10, "save_strategy": "no", "eval_strategy": "no",
            "report_to": "none", "seed": 42, "dataloader_num_workers": 0, "gradient_checkpointing": False}
SETUPS = {
    "hf_tune": "hf_tune GPU defaults (token-budget packs of 8,192)",
    "hf_tune_unchunked": "hf_tune, model.chunked_loss: false (the head on trained positions, whole)",
    "hf_tune_chunked": "hf_tune, model.chunked_loss: true (the loss a chunk of positions at a time)",
    "hf_tune_liger": "hf_tune + training.use_liger_kernel (Liger's RMSNorm, RoPE, SwiGLU kernels)",
    "trl_fastest": "TRL SFTTrainer, packing bfd + padding_free, 8 rows of 1,024",
    "trl_liger": "TRL SFTTrainer, packing bfd + padding_free + use_liger_kernel",
}


def build_model_folder(folder: Path, layers: int, hidden: int) -> None:
    """A random-init Llama of the given shape with SmolLM2's tokenizer, saved in bf16."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_tune.model.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path(TOKENIZER))
    heads = hidden // 128
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=4 if heads % 4 == 0 else heads,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def recipe_dict(model: Path, train: Path, out: Path, setup: str = "hf_tune") -> dict:
    recipe = {"model": {"pretrained_model_name_or_path": str(model), "dtype": "bfloat16"}, "lora": dict(LORA),
              "data": {"format": "chat", "train": {"path": str(train)}, "max_length": MAX_LENGTH,
                       "batch_tokens": TOKENS_PER_STEP},
              "training": {"output_dir": str(out), "resume_from_checkpoint": "never", **TRAINING}}
    if setup in ("hf_tune_unchunked", "hf_tune_chunked"):
        recipe["model"]["chunked_loss"] = setup == "hf_tune_chunked"
    if setup == "hf_tune_liger":
        recipe["training"]["use_liger_kernel"] = True
    return recipe


def run_setup(setup: str, model_dir: Path, train: Path, out: Path) -> dict:
    import shutil

    import torch

    from hf_tune import build_datasets, load_recipe
    from hf_tune import train as hf_train
    from hf_tune.model.attention import loaded_attn_implementation
    from hf_tune.model.loading import build_tokenizer

    shutil.rmtree(out, ignore_errors=True)
    recipe = load_recipe(recipe_dict(model_dir, train, out, setup))
    unpacked = recipe_dict(model_dir, train, out)
    unpacked["data"]["batch_tokens"] = None  # the chats themselves, for the token and FLOP counts
    trained_set, _ = build_datasets(load_recipe(unpacked), build_tokenizer(recipe))
    if setup.startswith("hf_tune"):
        trainer = hf_train(recipe)
        metrics = json.loads((out / "train_results.json").read_text())
    else:
        trainer = run_trl(setup, model_dir, train, out)
        metrics = trainer.state.log_history[-1]
    return {"setup": setup, "tokens": sum(len(ids) for ids in trained_set["input_ids"]),
            "seconds": metrics["train_runtime"], "train_loss": metrics["train_loss"],
            "flops": needed_flops(trainer.model, trained_set), "attention": loaded_attn_implementation(trainer.model),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def run_trl(setup: str, model_dir: Path, train: Path, out: Path):
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hf_tune.model.attention_choice import flash_candidates

    def to_prompt_completion(row):  # completion-only loss, as hf_tune trains only the assistant turn
        return {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]}

    data = load_dataset("json", data_files=str(train), split="train").map(to_prompt_completion,
                                                                         remove_columns=["messages"])
    flash = flash_candidates(torch.cuda.get_device_capability()) if torch.cuda.is_available() else []
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation=flash[0] if flash else "sdpa")
    config = SFTConfig(output_dir=str(out), max_length=MAX_LENGTH, per_device_train_batch_size=TOKENS_PER_STEP //
                       MAX_LENGTH, packing=True, packing_strategy="bfd", padding_free=True, bf16=True,
                       use_liger_kernel=setup == "trl_liger", **TRAINING)
    trainer = SFTTrainer(model=model, args=config, train_dataset=data,
                         processing_class=AutoTokenizer.from_pretrained(model_dir),
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA))
    trainer.train()
    return trainer


def run_in_subprocess(setup: str, ns) -> dict:
    if setup in ("trl_liger", "hf_tune_liger") and importlib.util.find_spec("liger_kernel") is None:
        return {"setup": setup, "failed": "liger-kernel is not installed (pip install liger-kernel)"}
    last = ns.work / f"{setup}.last.json"
    last.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, __file__, "--run", setup, "--work", str(ns.work)])
    if done.returncode == 0:
        return json.loads(last.read_text())
    return {"setup": setup, "failed": f"failed (exit {done.returncode}; its output is above)"}


def render(results: list[dict], ns) -> str:
    import torch

    from hf_tune.trainer.peak_flops import gpu_peak_flops

    done = [r for r in results if "failed" not in r]
    base = next((r for r in done if r["setup"] == "hf_tune"), done[0] if done else None)
    device = base["device"] if base else "?"
    peak = gpu_peak_flops(device, torch.bfloat16)
    lines = ["# GPU SFT throughput", "",
             f"Command: `python benchmarks/gpu_sft_throughput.py --examples {ns.examples} --layers {ns.layers} "
             f"--hidden {ns.hidden} --setups {ns.setups}`  ",
             f"Date: {datetime.date.today()}; card: {device}; bf16 data-sheet peak "
             f"{peak / 1e12:.0f} TFLOP/s.  " if peak else f"Date: {datetime.date.today()}; card: {device}.  ",
             f"Data: {ns.examples} chats from standard-library docstrings, one epoch, "
             f"{base['tokens']:,} real tokens; random-init Llama ({ns.layers} layers, hidden {ns.hidden}), "
             "LoRA r=16 on all linear layers, bf16." if base else "", "",
             "| setup | attention | real tok/s | hf_tune is | peak GPU memory GB | mean train loss | MFU |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {SETUPS[r['setup']]} | | {r['failed']} | | | | |")
            continue
        rate = r["tokens"] / r["seconds"]
        mfu = f"{r['flops'] / r['seconds'] / peak:.0%}" if peak else "?"
        lines.append(f"| {SETUPS[r['setup']]} | {r['attention']} | {rate:,.0f} "
                     f"| {base['tokens'] / base['seconds'] / rate:.2f}× | {r['peak_memory_gb']:.1f} "
                     f"| {r['train_loss']:.4f} | {mfu} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="training chats (one epoch)")
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--hidden", type=int, default=1536, help="a multiple of 128 (head_dim 128)")
    parser.add_argument("--setups", default="hf_tune,trl_fastest,trl_liger",
                        help=f"comma-separated, from {', '.join(SETUPS)}")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_gpu")
    parser.add_argument("--out", type=Path, help="where the table goes (default: WORK/gpu_sft_throughput.md)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one setup in this process
    ns = parser.parse_args()
    model_dir, train = ns.work / "model", ns.work / "data" / "train.jsonl"
    if ns.run:
        result = run_setup(ns.run, model_dir, train, ns.work / ns.run)
        (ns.work / f"{ns.run}.last.json").write_text(json.dumps(result))
        return
    setups = ns.setups.split(",")
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        parser.error(f"unknown setup(s) {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (benchmarks/sft_throughput.py is the CPU benchmark)")
    write_data(ns.work / "data", ns.examples)
    build_model_folder(model_dir, ns.layers, ns.hidden)
    results = []
    for setup in setups:
        print(f"== {setup}: {SETUPS[setup]}", flush=True)
        results.append(run_in_subprocess(setup, ns))
    table = render(results, ns)
    print(table)
    (ns.out or ns.work / "gpu_sft_throughput.md").write_text(table)


if __name__ == "__main__":
    main()
