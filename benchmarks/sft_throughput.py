"""SFT throughput: hf_tune's default LLM recipe against plain Trainer setups and TRL, side by side in one run.

    python benchmarks/sft_throughput.py                 # or: make bench
    python benchmarks/sft_throughput.py --examples 400 --setups hf_tune,flattening
    python benchmarks/sft_throughput.py --repeat 3      # hf_tune and the hand-written script 3 times each, interleaved
    python benchmarks/sft_throughput.py --data foreign --examples 120 --setups hf_tune,flattening

Every setup trains the embedded SmolLM2-135M-Instruct with the same LoRA (r=16, all linear layers), learning rate,
seed and about 1,000 tokens per step for one epoch over the same chats, each in its own process (one at a time: run
it on an idle machine). Two data sets, one table each (`--data`): `ours`, chats built offline from the docstrings of
Python's standard library (20 to 1,024 tokens, mean about 120; LoRA dropout 0.05), and `foreign`, a set we did not
shape: another domain (the installed packages' own README text, from their METADATA, one section per chat, as the
authors wrote it) behind short questions, with LoRA dropout 0. Reported: real (non-pad) tokens per second over the
epoch, its ratio to hf_tune, peak RSS, the mean training loss, the loss on 32 held-out chats, and MFU: the FLOPs the
training needs (hf_tune.trainer.throughput's count, identical for every setup) over the measured matmul peak. On a
2-core CPU the default run takes about 45 minutes per data set (TRL's defaults 16, the padded batch-8 run 8 before the
OOM killer stops it); `--setups` picks fewer. The `hf_tune_*` setups are the default recipe with one key changed, to
measure a switch in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import pkgutil
import platform
import random
import re
import resource
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "embedded:SmolLM2-135M-Instruct"
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}
DATA_SETS = {  # name: (what the table says, LoRA dropout)
    "ours": ("chats from standard-library docstrings", 0.05),
    "foreign": ("chats from installed packages' README sections behind short questions (not shaped by us)", 0.0),
}
TRAINING = {"learning_rate": 2.0e-4, "num_train_epochs": 1, "lr_scheduler_type": "cosine", "warmup_steps": 0.1,
            "weight_decay": 0.0, "logging_steps": 5, "save_strategy": "no", "eval_strategy": "no",
            "report_to": "none", "seed": 42, "use_cpu": True, "dataloader_num_workers": 0}
BATCH, BATCH_TOKENS, MAX_LENGTH = 8, 1024, 1024
SETUPS = {
    "hf_tune": "hf_tune default recipe (token-budget packs of 1,024)",
    "padded": "plain Trainer, padded batches of 8",
    "padded_accum": "plain Trainer, padded batches of 4 × 2 accumulation steps",
    "flattening": "Trainer + DataCollatorWithFlattening, batches of 8",
    "trl_default": "TRL SFTTrainer defaults, batches of 8",
    "trl_fastest": "TRL packing bfd + padding-free, no checkpointing, rows of 1,024",
    "handwritten": "hand-written Trainer script doing what hf_tune does",
    "hf_tune_chunked": "hf_tune, model.chunked_loss: true",
    "hf_tune_unchunked": "hf_tune, model.chunked_loss: false",
    "hf_tune_foreach_adamw": "hf_tune, training.optim: adamw_torch (foreach, not fused)",
}
DEFAULT_SETUPS = [name for name in SETUPS if not name.startswith("hf_tune_")]
HF_TUNE_VARIANTS = {  # setup: the one change to the default recipe, as (section, key, value)
    "hf_tune_chunked": ("model", "chunked_loss", True),
    "hf_tune_unchunked": ("model", "chunked_loss", False),
    "hf_tune_foreach_adamw": ("training", "optim", "adamw_torch"),
}


# ---------------------------------------------------------------- data

def stdlib_docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) of public functions and classes of pure-Python standard library modules."""
    found = []
    skip = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "lib2to3", "ensurepip", "pydoc_data")
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        path = getattr(info.module_finder, "path", "")
        if info.name.startswith("_") or info.name in skip or "site-packages" in path or not path:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = __import__(info.name)
        except Exception:  # noqa: BLE001 - platform-specific modules
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and inspect.getdoc(obj):
                found.append((f"{info.name}.{name}", inspect.getdoc(obj)))
    return found


def build_chats(n: int, seed: int = 0) -> list[dict]:
    """Chats asking what a standard-library function or class does, answered with its docstring."""
    questions = ["What does `{}` do?", "Explain `{}` from the Python standard library.", "How do I use `{}`?"]
    rng = random.Random(seed)
    docs = stdlib_docstrings()
    rng.shuffle(docs)
    return [{"messages": [{"role": "user", "content": rng.choice(questions).format(name)},
                          {"role": "assistant", "content": doc}]} for name, doc in docs[:n]]


def package_readme_sections() -> list[tuple[str, str, str]]:
    """(package, section heading or "", section text) of the long descriptions of the installed distributions, split
    at Markdown (``#``) and reStructuredText (underlined) headings; text as the authors wrote it."""
    import importlib.metadata

    found, seen = [], set()
    underline = re.compile(r"^([=\-~^*#+`])\1{2,}\s*$")
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"]
        text = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if not name or name.lower() in seen or not isinstance(text, str):
            continue
        seen.add(name.lower())
        heading, body, lines, fenced = "", [], text.splitlines(), False
        for i, line in enumerate(lines):
            fenced ^= line.lstrip().startswith("```")  # a "# comment" in a code block is no heading
            rst_heading = i + 1 < len(lines) and line[:1].strip() and underline.match(lines[i + 1]) and \
                len(lines[i + 1].strip()) >= len(line.strip())
            if not fenced and re.search(r"[A-Za-z]", line) and (line.startswith("#") or rst_heading):
                found.append((name, heading, "\n".join(body).strip()))
                heading, body = line.lstrip("#").strip(), []
            elif not underline.match(line):
                body.append(line)
        found.append((name, heading, "\n".join(body).strip()))
    return [(name, heading, text) for name, heading, text in found if len(text) >= 80]


def build_foreign_chats(n: int, seed: int = 0) -> list[dict]:
    """Chats asking briefly about an installed package, answered with a section of its README."""
    rng = random.Random(seed)
    sections = package_readme_sections()
    rng.shuffle(sections)
    return [{"messages": [{"role": "user", "content": f"Describe the package {name}." if not heading
                           else f"{name}: {heading}?"},
                          {"role": "assistant", "content": text}]} for name, heading, text in sections[:n]]


def write_data(folder: Path, n: int, data: str = "ours") -> tuple[Path, Path]:
    chats = (build_foreign_chats if data == "foreign" else build_chats)(n + 32)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "train.jsonl", folder / "eval.jsonl"
    for path, rows in zip(paths, (chats[:n], chats[n:])):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


# ---------------------------------------------------------------- one setup, in its own process

def lora_of(data: str) -> dict:
    return {**LORA, "lora_dropout": DATA_SETS[data][1]}


def recipe_dict(train: Path, out: Path, data: str = "ours") -> dict:
    """recipes/llm_lora.yaml as shipped, pointed at the benchmark data for one epoch with the shared settings."""
    import yaml

    recipe = yaml.safe_load((ROOT / "recipes" / "llm_lora.yaml").read_text())
    recipe["lora"] = lora_of(data)
    recipe["data"].update(train={"path": str(train)}, max_length=MAX_LENGTH)
    recipe["data"].pop("eval_split", None)
    recipe["training"] = {"output_dir": str(out), "resume_from_checkpoint": "never", **TRAINING,
                          **{k: v for k, v in recipe["training"].items() if k.startswith("per_device_train")}}
    return recipe


def run_setup(setup: str, train: Path, evaluation: Path, out: Path, data: str = "ours") -> dict:
    import torch
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainingArguments

    from hf_tune import build_datasets, build_model_and_tokenizer, load_recipe
    from hf_tune import train as hf_train
    from hf_tune.data import causal_lm_loss
    from hf_tune.data.collator import CausalLMCollator
    from hf_tune.data.packing import pack_by_token_budget

    shutil.rmtree(out, ignore_errors=True)  # a fresh run folder: hf_tune refuses to start over a finished run
    raw = recipe_dict(train, out, data)
    if setup in HF_TUNE_VARIANTS:
        section, key, value = HF_TUNE_VARIANTS[setup]
        raw[section] = {**raw[section], key: value}
    plain = {**raw, "data": {**raw["data"], "batch_tokens": None, "eval": {"path": str(evaluation)}},
             # the upstream setups get PEFT's own LoRA (nn.Dropout) and transformers' SDPA; the hand-written one
             # does what hf_tune does (FastDropout, sdpa_varlen with flattened packs)
             "model": {**raw["model"], "fast_lora_dropout": setup == "handwritten",
                       "attn_implementation": "sdpa_varlen" if setup == "handwritten" else "sdpa"}}
    model, tokenizer = build_model_and_tokenizer(load_recipe(plain))
    trained_set, eval_set = build_datasets(load_recipe(plain), tokenizer)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH, **TRAINING)
    if setup == "hf_tune" or setup in HF_TUNE_VARIANTS:
        del model
        trainer = hf_train(load_recipe(raw))
        model, metrics = trainer.model, json.loads((out / "train_results.json").read_text())
    elif setup in ("padded", "padded_accum", "flattening"):
        collator = (DataCollatorWithFlattening() if setup == "flattening" else
                    DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100))
        if setup == "padded_accum":  # what a user does when batches of 8 run out of memory: the same 8 per step
            args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH // 2,
                                     gradient_accumulation_steps=2, **TRAINING)
        trainer = Trainer(model=model, args=args, train_dataset=trained_set, data_collator=collator)
        metrics = trainer.train().metrics
    elif setup == "handwritten":
        packs = pack_by_token_budget(trained_set, BATCH_TOKENS, 42)
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=1, **TRAINING)
        trainer = Trainer(model=model, args=args, train_dataset=packs, compute_loss_func=causal_lm_loss,
                          data_collator=CausalLMCollator(tokenizer, padding_free=True, trainable_logits_only=True,
                                                         example_boundaries=True))
        metrics = trainer.train().metrics
    else:
        trainer = run_trl(setup, model, tokenizer, train, out, lora_of(data))
        model, metrics = trainer.model, trainer.state.log_history[-1]
    tokens = sum(len(ids) for ids in trained_set["input_ids"])
    trained = sum(sum(1 for a in labels[1:] if a != -100) for labels in trained_set["labels"])
    return {"setup": setup, "tokens": tokens, "trained_tokens": trained, "seconds": metrics["train_runtime"],
            "train_loss": metrics["train_loss"],
            "eval_loss": held_out_loss(model, tokenizer, eval_set), "flops": needed_flops(model, trained_set),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "threads": torch.get_num_threads()}


def run_trl(setup: str, model, tokenizer, train: Path, out: Path, lora: dict) -> dict:
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    def to_prompt_completion(row):  # completion-only loss, as hf_tune trains only the assistant turn
        return {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]}

    data = load_dataset("json", data_files=str(train), split="train").map(to_prompt_completion,
                                                                         remove_columns=["messages"])
    fastest = setup == "trl_fastest"
    # bf16=False: TRL 1.x defaults to bf16 autocast even on CPU (without AMX, >100 s a step here); every setup is fp32
    config = SFTConfig(output_dir=str(out), max_length=MAX_LENGTH, per_device_train_batch_size=1 if fastest else BATCH,
                       bf16=False,
                       **({"packing": True, "packing_strategy": "bfd", "padding_free": True,
                           "gradient_checkpointing": False} if fastest else {}), **TRAINING)
    model = model.unload() if hasattr(model, "unload") else model  # TRL applies the same LoRA itself
    from peft import LoraConfig

    trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **lora))
    trainer.train()
    return trainer


def held_out_loss(model, tokenizer, eval_set) -> float:
    """Mean next-token loss over the trained tokens of the held-out chats (the same function for every setup)."""
    import torch
    from transformers import DataCollatorForSeq2Seq

    from hf_tune.data import causal_lm_loss

    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(eval_set), 8):
            batch = collate([eval_set[j] for j in range(i, min(i + 8, len(eval_set)))])
            labels = batch.pop("labels")
            n = int((labels[:, 1:] != -100).sum())
            total += causal_lm_loss(model(**batch), labels).item() * n
            count += n
    return total / count


def needed_flops(model, trained_set) -> float:
    """FLOPs that one epoch of training needs: the LM head on trained positions only (hf_tune.trainer.throughput's
    count)."""
    from hf_tune.trainer.throughput import model_flops

    flops = model_flops(model, causal=True)
    trained = sum(sum(1 for a in labels[1:] if a != -100) for labels in trained_set["labels"])
    return flops.batch_flops([len(ids) for ids in trained_set["input_ids"]], trained)


# ---------------------------------------------------------------- the comparison

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=160, help="training chats of each data set (one epoch)")
    parser.add_argument("--data", default=",".join(DATA_SETS),
                        help=f"comma-separated data sets, one table each, from {', '.join(DATA_SETS)}")
    parser.add_argument("--setups", default=",".join(DEFAULT_SETUPS),
                        help=f"comma-separated, from {', '.join(SETUPS)}")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the results of setups already measured in --work (same data) and run the rest")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each --repeat-setups setup, in interleaved rounds; the table reports the median")
    parser.add_argument("--repeat-setups", default="hf_tune,handwritten",
                        help="the setups run --repeat times (default: the close comparison); the others run once")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: one setup in this process
    ns = parser.parse_args()
    setups, data_sets = ns.setups.split(","), ns.data.split(",")
    unknown = sorted(set(setups) - set(SETUPS))
    if unknown:
        parser.error(f"unknown setup(s) {', '.join(unknown)}; choose from {', '.join(SETUPS)}")
    if set(data_sets) - set(DATA_SETS):
        parser.error(f"unknown data set(s) {', '.join(sorted(set(data_sets) - set(DATA_SETS)))}; choose from "
                     f"{', '.join(DATA_SETS)}")
    if ns.run:
        work = ns.work / data_sets[0]
        result = run_setup(ns.run, work / "data" / "train.jsonl", work / "data" / "eval.jsonl", work / ns.run,
                           data_sets[0])
        (work / f"{ns.run}.last.json").write_text(json.dumps(result))
        return
    import torch

    from hf_tune.trainer.peak_flops import measured_peak_flops

    peak = measured_peak_flops(torch.device("cpu"), torch.float32)
    tables = [measure(data, setups, peak, ns) for data in data_sets]
    print("\n".join(tables))
    ns.results.write_text("\n".join(tables))


def measure(data: str, setups: list[str], peak: float, ns) -> str:
    """Every setup on one data set (in ``--work``/``data``), in rounds; the table of that data set."""
    work = ns.work / data
    write_data(work / "data", ns.examples, data)
    runs: dict[str, list[dict]] = {}
    for setup in setups:
        saved = work / f"{setup}.json"
        runs[setup] = json.loads(saved.read_text()) if ns.reuse and saved.is_file() else []
        if not isinstance(runs[setup], list):  # a file from before --repeat: one run
            runs[setup] = [runs[setup]]
    measured_now: set[str] = set()
    # Rounds: every setup once per round, so a drift of the machine's speed hits all setups alike.
    wanted = {setup: ns.repeat if setup in ns.repeat_setups.split(",") else 1 for setup in setups}
    for round_ in range(ns.repeat):
        for setup in setups:
            if round_ >= wanted[setup] or len(runs[setup]) > round_ or (runs[setup] and "failed" in runs[setup][0]):
                continue
            print(f"== {data}: {setup} (run {round_ + 1} of {wanted[setup]}): {SETUPS[setup]}", flush=True)
            runs[setup].append(run_in_subprocess(setup, ns.work, data))
            measured_now.add(setup)
            (work / f"{setup}.json").write_text(json.dumps(runs[setup]))
    results = [summarise(runs[setup][:wanted[setup]]) for setup in setups]
    return render(results, peak, ns, data, reused=[setup for setup in setups if setup not in measured_now])


def run_in_subprocess(setup: str, work: Path, data: str) -> dict:
    (work / data / f"{setup}.last.json").unlink(missing_ok=True)
    done = subprocess.run([sys.executable, __file__, "--run", setup, "--work", str(work), "--data", data])
    if done.returncode == 0:
        return json.loads((work / data / f"{setup}.last.json").read_text())
    # -9: the kernel's OOM killer, as padded batches of long chats can need more than the machine has
    return {"setup": setup, "failed": "killed: out of memory" if done.returncode == -9
            else f"failed (exit {done.returncode})"}


def summarise(runs: list[dict]) -> dict:
    """The run with the median time stands for the setup; the spread of tokens/s over all runs goes with it."""
    if "failed" in runs[0]:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r["seconds"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["rates"] = [r["tokens"] / r["seconds"] for r in ordered]
    return median


def render(results: list[dict], peak: float, ns, data: str, reused: list[str]) -> str:
    done = [r for r in results if "failed" not in r]
    base = next((r for r in done if r["setup"] == "hf_tune"), done[0])
    rate = {r["setup"]: r["tokens"] / r["seconds"] for r in done}
    repeat = f" --repeat {ns.repeat} --repeat-setups {ns.repeat_setups}" if ns.repeat > 1 else ""
    lines = [f"# SFT throughput: {data} data", "",
             f"Command: `python benchmarks/sft_throughput.py --examples {ns.examples} --data {ns.data} "
             f"--setups {ns.setups}{repeat}{' --reuse' if ns.reuse else ''}`  ",
             f"Date: {datetime.date.today()}; machine: {platform.processor() or platform.machine()}, "
             f"{base['threads']} torch threads, no GPU; measured fp32 matmul peak {peak / 1e9:.0f} GFLOP/s.  ",
             f"Data: {ns.examples} {DATA_SETS[data][0]}, one epoch, {base['tokens']:,} real tokens "
             f"({base.get('trained_tokens', 0):,} trained); SmolLM2-135M-Instruct, LoRA r=16 on all linear layers, "
             f"dropout {DATA_SETS[data][1]}.  ",
             "Tokens/s: the median run; in brackets every run, fastest first (rounds ran each setup once in turn).  ",
             *([f"Reused from an earlier invocation in the same --work (--reuse, same data), not run by this one: "
                f"{', '.join(reused)}."] if reused else []), "",
             "| setup | real tok/s | hf_tune is | peak RSS GB | mean train loss | held-out loss | MFU |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {SETUPS[r['setup']]} | {r['failed']} | | | | | |")
            continue
        mfu = r["flops"] / r["seconds"] / peak
        spread = f" ({', '.join(f'{x:.0f}' for x in r['rates'])})" if len(r.get("rates", ())) > 1 else ""
        lines.append(f"| {SETUPS[r['setup']]} | {rate[r['setup']]:.0f}{spread} "
                     f"| {rate[base['setup']] / rate[r['setup']]:.2f}× | {r['peak_rss_gb']:.1f} "
                     f"| {r['train_loss']:.4f} | {r['eval_loss']:.4f} | {mfu:.0%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
