"""Does `plan` hold at real size? An 8B-shaped model trained on one GPU, measured against plan's figure for the same
recipe, then TRL + Liger on the same model, data and steps, side by side.

    python benchmarks/gpu_scale.py                # one GPU, about 6 minutes on an H100 / H200, no network
    python benchmarks/gpu_scale.py --tiny         # the same path on a 2-layer, 256-wide copy (CPU or GPU): a smoke test

The model is Llama-3.1-8B's shape (hf_tune's shipped config.json), random weights created on the GPU in bf16: nothing
is downloaded; SmolLM2's tokenizer (whose ids all fall inside Llama-3.1's vocabulary) makes the chats' tokens. The
recipe is what `hf-tune init meta-llama/Llama-3.1-8B-Instruct --gpus 1 --gpu-memory 80` writes (LoRA r16 on every
linear layer, dropout 0.05, packs of the tokens init chose), trained for ``--steps`` optimizer steps of one pack
each, in its own process per setup:

- hf_tune: the recipe as init wrote it (activation checkpointing as init chose);
- hf_tune_checkpointing: the same with activation checkpointing on;
- trl_liger: TRL's SFTTrainer with use_liger_kernel, packing (bfd) + padding_free, one row of the same tokens.

Reported per setup: torch.cuda.max_memory_allocated / max_memory_reserved, and plan's figures for the same recipe
(model states + activations at their peak, which allocated is compared with; and the estimated peak per rank, which
adds the 3 GB runtime reserve and is compared with reserved), tokens/s and MFU from hf_tune's throughput counter
(TRL's: the same tokens over its train_runtime). Then `make test-gpu` runs the GPU suite. The table goes to stdout
and to --out; copy it into benchmarks/RESULTS.md with the card's name.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from sft_throughput import LORA, write_data  # noqa: E402  (the CPU benchmark's chats and LoRA)

MODEL_ID = "meta-llama/Llama-3.1-8B-Instruct"
TOKENIZER = "embedded:SmolLM2-135M-Instruct"
SETUPS = {
    "hf_tune": "hf_tune, the recipe init wrote for 1 x 80 GB",
    "hf_tune_checkpointing": "hf_tune, the same with activation checkpointing on",
    "trl_liger": "TRL SFTTrainer + use_liger_kernel, packing bfd + padding_free, the same tokens a step",
}


def model_folder(folder: Path, tiny: bool) -> Path:
    """config.json (Llama-3.1-8B's, or a 2-layer 256-wide copy) and SmolLM2's tokenizer files: no weights."""
    from transformers import AutoConfig, AutoTokenizer

    from hf_tune.model.embedded import embedded_model_path
    from hf_tune.model.meta import shipped_config_path

    config = AutoConfig.from_pretrained(str(shipped_config_path(MODEL_ID)))
    if tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 256, 768
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 64
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(embedded_model_path(TOKENIZER)).save_pretrained(folder)
    return folder


def init_recipe(folder: Path, train: Path, out: Path, steps: int, tiny: bool) -> dict:
    """The recipe `hf-tune init` writes for the model on 1 x 80 GB, trained ``steps`` optimizer steps of one pack."""
    import yaml

    from hf_tune.workflows.init_recipe import choose

    recipe, _ = choose(MODEL_ID, 1, 80, data=str(train), output_dir=str(out))
    recipe = yaml.safe_load(yaml.safe_dump(recipe))  # a plain copy
    recipe["model"]["pretrained_model_name_or_path"] = str(folder)
    if tiny:
        recipe["data"]["batch_tokens"] = recipe["data"]["max_length"] = 1024
    recipe["training"].update(max_steps=steps, gradient_accumulation_steps=1, logging_steps=max(1, steps // 4),
                              save_strategy="no", report_to="none", resume_from_checkpoint="never")
    recipe.pop("machine", None)
    return recipe


def run_setup(setup: str, ns) -> dict:
    import torch

    from hf_tune import load_recipe
    from hf_tune.assembly.run_build import build_trainer
    from hf_tune.data import build_training_data
    from hf_tune.model.attention import loaded_attn_implementation
    from hf_tune.model.attention_choice import apply_attention
    from hf_tune.model.loading import build_tokenizer, wrap_lora
    from hf_tune.training_args import build_training_arguments
    from hf_tune.workflows.plan import plan

    out = ns.work / setup
    shutil.rmtree(out, ignore_errors=True)
    raw = json.loads((ns.work / "recipe.json").read_text())
    raw["training"]["output_dir"] = str(out)
    if setup == "hf_tune_checkpointing":
        raw["training"].update(activation_checkpointing=True,
                               activation_checkpointing_kwargs={"use_reentrant": False})
    recipe = load_recipe(raw)
    planned = plan(recipe, out_dir=out / "plan")
    args = build_training_arguments(recipe)
    tokenizer = build_tokenizer(recipe)
    data = build_training_data(recipe, tokenizer, args)
    model = random_model(ns.work / "model", ns.device)
    result = {"setup": setup, "device": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu",
              "plan_states_and_activations_gb": (planned["peak_per_rank"] - 3 * 2**30) / 2**30,
              "plan_peak_gb": planned["peak_per_rank"] / 2**30,
              "plan_activations_gb": planned["activations"]["peak_bytes"] / 2**30,
              "tokens_per_pack": recipe.data.batch_tokens,
              "checkpointing": planned["activations"]["checkpointing"]}
    if ns.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if setup.startswith("hf_tune"):
        apply_attention(model, planned["decisions"]["attention"])  # plan's decision, as build_run applies it
        model = wrap_lora(model, recipe)
        trainer = build_trainer(recipe, model, tokenizer, data.train, None, args)
        metrics = trainer.train().metrics
        tokens_per_second, mfu = metrics.get("train_tokens_per_second"), metrics.get("train_mfu")
    else:
        trainer, tokens_per_second, mfu = run_trl(model, tokenizer, recipe, out, ns)
    result.update(attention=loaded_attn_implementation(trainer.model), tokens_per_second=tokens_per_second, mfu=mfu)
    if ns.device == "cuda":
        result.update(allocated_gb=torch.cuda.max_memory_allocated() / 2**30,
                      reserved_gb=torch.cuda.max_memory_reserved() / 2**30)
    return result


def random_model(folder: Path, device: str):
    """The model of ``folder``'s config with random weights, created on ``device`` in bf16 (no file is read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            return AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)


def run_trl(model, tokenizer, recipe, out: Path, ns):
    """TRL's SFTTrainer with Liger on the same model, chats, pack size and steps; tokens/s over its runtime."""
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    data = load_dataset("json", data_files=str(ns.work / "data" / "train.jsonl"), split="train")
    config = SFTConfig(output_dir=str(out), max_length=recipe.data.batch_tokens, per_device_train_batch_size=1,
                       packing=True, packing_strategy="bfd", padding_free=True, bf16=True, report_to="none",
                       max_steps=recipe.training["max_steps"], learning_rate=2e-4, logging_steps=5,
                       save_strategy="no", use_liger_kernel=importlib.util.find_spec("liger_kernel") is not None,
                       use_cpu=ns.device == "cpu")
    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA))
    metrics = trainer.train().metrics
    tokens = recipe.data.batch_tokens * recipe.training["max_steps"]  # full packs: an upper bound on TRL's tokens
    return trainer, tokens / metrics["train_runtime"], None


def run_in_subprocess(setup: str, ns) -> dict:
    last = ns.work / f"{setup}.last.json"
    last.unlink(missing_ok=True)
    command = [sys.executable, __file__, "--run", setup, "--work", str(ns.work), "--steps", str(ns.steps)]
    done = subprocess.run(command + (["--tiny"] if ns.tiny else []))
    if done.returncode == 0:
        return json.loads(last.read_text())
    return {"setup": setup, "failed": f"failed (exit {done.returncode}; its output is above)"}


def render(results: list[dict], ns) -> str:
    def gb(value) -> str:
        return f"{value:.1f}" if isinstance(value, (int, float)) else "-"

    done = [r for r in results if "failed" not in r]
    device = done[0]["device"] if done else "?"
    lines = ["# Plans at real size: an 8B-shaped model on one GPU", "",
             f"Command: `python benchmarks/gpu_scale.py --steps {ns.steps}{' --tiny' if ns.tiny else ''}`  ",
             f"Date: {datetime.date.today()}; card: {device}.", "",
             "| setup | attention | checkpointing | tokens a pack | allocated GB | plan: states + activations GB "
             "| allocated / plan | reserved GB | plan: peak per rank GB | tok/s | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {SETUPS[r['setup']]} | {r['failed']} |||||||||")
            continue
        ratio = (f"{r['allocated_gb'] / r['plan_states_and_activations_gb']:.2f}" if r.get("allocated_gb") else "-")
        lines.append(f"| {SETUPS[r['setup']]} | {r['attention']} | {'on' if r['checkpointing'] else 'off'} "
                     f"| {r['tokens_per_pack']:,} | {gb(r.get('allocated_gb'))} "
                     f"| {gb(r['plan_states_and_activations_gb'])} | {ratio} | {gb(r.get('reserved_gb'))} "
                     f"| {gb(r['plan_peak_gb'])} | {r['tokens_per_second'] or 0:,.0f} "
                     f"| {'-' if r['mfu'] is None else format(r['mfu'], '.0%')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per setup (one pack each)")
    parser.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, from {', '.join(SETUPS)}")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 256-wide copy: the path, not the figures")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_gpu_scale")
    parser.add_argument("--out", type=Path, help="where the table goes (default: WORK/gpu_scale.md)")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one setup in this process
    ns = parser.parse_args()
    import torch

    ns.device = "cuda" if torch.cuda.is_available() else "cpu"
    if ns.run:
        (ns.work / f"{ns.run}.last.json").write_text(json.dumps(run_setup(ns.run, ns)))
        return
    if ns.device == "cpu" and not ns.tiny:
        parser.error("needs a CUDA GPU (--tiny runs the same path on a small copy)")
    setups = ns.setups.split(",")
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        parser.error(f"unknown setup(s) {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
    train, _ = write_data(ns.work / "data", 60 if ns.tiny else 1500)
    folder = model_folder(ns.work / "model", ns.tiny)
    (ns.work / "recipe.json").write_text(json.dumps(init_recipe(folder, train, ns.work / "run", ns.steps, ns.tiny)))
    results = []
    for setup in setups:
        print(f"== {setup}: {SETUPS[setup]}", flush=True)
        results.append(run_in_subprocess(setup, ns))
    table = render(results, ns)
    print(table)
    (ns.out or ns.work / "gpu_scale.md").write_text(table)


if __name__ == "__main__":
    main()
