"""DPO on long third-party pairs: where the bytes go, and peak RSS / speed against plain TRL, side by side.

  python benchmarks/dpo_memory.py breakdown        one hf_tune DPO step (checkpointing off) in one process: weights,
                                                   saved-for-backward activations by module kind, the fused head's
                                                   tile, optimizer state, the Python/torch baseline
  python benchmarks/dpo_memory.py compare          one epoch per setup, each in its own fresh process, one after the
  python benchmarks/dpo_memory.py compare --setups trl_no_ckpt,hf_tune_ckpt        other (the setups: SETUPS)

The data: 16 pairs in LLaMA-Factory's dpo_en_demo layout (`conversations` / `chosen` / `rejected`), written here,
offline, from the docstrings of Python's standard library: the question names a function or class, the chosen answer
is its docstring, the rejected one another object's docstring of about the same length; each pair's prompt and answer
are about 300 to 600 tokens, so `max_length` 512 truncates some. Every setup: the embedded SmolLM2-135M-Instruct in
float32 on the CPU, LoRA r=16 (alpha 32) on all linear layers, 4 pairs a step (8 sequences), `max_length` 512,
beta 0.1, learning rate 2e-4, seed 42, one epoch (4 steps). Reported: peak RSS of the child (ru_maxrss), s/step of
the training loop, the reference pass of the setups that precompute it (timed apart), the total for the epoch
(loop + reference pass), and the loss at step 1 and step 4.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
MODEL = "embedded:SmolLM2-135M-Instruct"
PAIRS, BATCH, MAX_LENGTH = 16, 4, 512
SETUPS = {
    "trl_no_ckpt": "plain TRL DPOTrainer, activation checkpointing off (as issue #33 measured), reference forward "
                   "every step (adapter disabled)",
    "hf_tune_ckpt": "hf_tune, activation checkpointing on (TRL's default, kept), pairs as one flattened row (its "
                    "default, hf_tune/model/flat_pairs.py), reference precomputed once",
    "hf_tune_ckpt_padded": "hf_tune, activation checkpointing on, pairs padded as TRL pads them "
                           "(training.padding_free: false), reference precomputed once",
    "trl_default": "plain TRL DPOTrainer, its default activation checkpointing on, reference forward every step",
    "hf_tune": "hf_tune, recipes/llm_dpo.yaml as shipped: checkpointing off, reference precomputed once",
}
GiB = 2**30


# ---------------------------------------------------------------- data

def build_pairs(tokenizer, n: int = PAIRS, seed: int = 0) -> list[dict]:
    """``n`` LLaMA-Factory dpo_en_demo pairs whose chosen answer (a docstring) is 250 to 560 tokens long; the
    rejected answer is the docstring closest in length among the others."""
    from sft_throughput import stdlib_docstrings  # the same offline source as the SFT benchmark

    rng = random.Random(seed)
    docs = [(name, doc, len(tokenizer(doc)["input_ids"])) for name, doc in stdlib_docstrings()]
    long = [d for d in docs if 250 <= d[2] <= 560]
    rng.shuffle(long)
    chosen, pool = long[:n], long[n:]
    pairs = []
    for name, doc, length in chosen:
        wrong = min(pool, key=lambda d: abs(d[2] - length))
        pool.remove(wrong)
        pairs.append({"conversations": [{"from": "human", "value": f"Explain `{name}` from the Python standard "
                                                                     "library, as its documentation does."}],
                      "chosen": {"from": "gpt", "value": doc}, "rejected": {"from": "gpt", "value": wrong[1]}})
    return pairs


def write_pairs(folder: Path) -> Path:
    from transformers import AutoTokenizer

    from hf_tune.model.loading import resolve_model_path

    path = folder / "dpo_long_pairs.json"
    path.write_text(json.dumps(build_pairs(AutoTokenizer.from_pretrained(resolve_model_path(MODEL))), indent=1))
    return path


# ---------------------------------------------------------------- one setup, in its own process

def hf_tune_recipe(data: Path, out: Path, checkpointing: bool, *more: str):
    from hf_tune import load_recipe

    return load_recipe(REPO / "recipes" / "llm_dpo.yaml", [
        f"data.train.path={data}", "data.eval_split=null", f"training.max_length={MAX_LENGTH}",
        f"training.per_device_train_batch_size={BATCH}", "training.max_steps=-1", "training.num_train_epochs=1",
        f"training.output_dir={out}", "training.save_strategy=no", "training.eval_strategy=no",
        "training.logging_steps=1", "training.disable_tqdm=true", "training.warmup_steps=0",
        f"training.activation_checkpointing={str(checkpointing).lower()}", *more])


def plain_trl_trainer(data: Path, out: Path, checkpointing: bool):
    """TRL's DPOTrainer as a TRL user writes it: the same tokenizer, data rows, LoRA and arguments, TRL's defaults
    for everything else (the reference: the adapter disabled, a forward every step)."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from hf_tune.data.preference import load_method_data
    from hf_tune.model import build_tokenizer
    from hf_tune.model.loading import resolve_model_path

    recipe = hf_tune_recipe(data, out, checkpointing)
    tokenizer = build_tokenizer(recipe)
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL), dtype=torch.float32)
    t = recipe.training
    args = DPOConfig(output_dir=str(out), beta=t["beta"], max_length=MAX_LENGTH, per_device_train_batch_size=BATCH,
                     num_train_epochs=1, learning_rate=t["learning_rate"], lr_scheduler_type=t["lr_scheduler_type"],
                     logging_steps=1, save_strategy="no", bf16=False, use_cpu=True, report_to="none", seed=t["seed"],
                     disable_tqdm=True, activation_checkpointing=checkpointing)
    rows = load_method_data(recipe.data, "dpo", t["seed"])[0]
    return DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                      peft_config=LoraConfig(task_type="CAUSAL_LM", **recipe.lora))


def build_trainer(setup: str, data: Path, out: Path):
    from hf_tune.assembly.run_build import build_run

    if setup.startswith("trl_"):
        return plain_trl_trainer(data, out, checkpointing=setup == "trl_default")
    more = ["training.padding_free=false"] if setup.endswith("_padded") else []
    return build_run(hf_tune_recipe(data, out, setup.startswith("hf_tune_ckpt"), *more)).trainer


def timed_reference_pass() -> dict:
    """Time TRL's reference pass (hf_tune's cache calls it on a miss; the cache folder here is fresh)."""
    from trl import DPOTrainer

    timing = {"seconds": 0.0}
    precompute = DPOTrainer._precompute_ref_logps

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return precompute(self, *args, **kwargs)
        finally:
            timing["seconds"] += time.perf_counter() - start

    DPOTrainer._precompute_ref_logps = timed
    return timing


def compare_child(setup: str, data: Path, work: Path) -> dict:
    reference = timed_reference_pass()
    trainer = build_trainer(setup, data, work / setup)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    steps = trainer.state.global_step
    return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB, "steps": steps,
            "s_per_step": seconds / steps, "reference_s": reference["seconds"],
            "epoch_s": seconds + reference["seconds"], "losses": losses,
            "checkpointing": bool(trainer.args.gradient_checkpointing),
            "precompute": bool(trainer.args.precompute_ref_log_probs),
            "flat_pairs": bool(getattr(trainer, "flat_pairs", False))}


# ---------------------------------------------------------------- breakdown of one step

def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def module_kind(name: str, module) -> str:
    """The row of the breakdown a saved tensor counts in: the innermost module that saved it."""
    leaf = name.rsplit(".", 1)[-1]
    if "lora_" in name:
        return "LoRA A/B (their inputs)"
    if "norm" in leaf or "Norm" in type(module).__name__:
        return "RMSNorm"
    if ".self_attn" in name:
        return "attention: rotary, SDPA"
    if ".mlp" in name:
        return "MLP: SiLU, gate * up"
    if ".layers." in name:
        return "decoder layer: residual adds"
    if "embed" in name:
        return "embeddings"
    return "LM head (TRL's fused, tiled) and loss"


def breakdown(data: Path, work: Path) -> dict:
    """One hf_tune DPO training step with checkpointing off: what holds the bytes at its peak."""
    import torch

    baseline = rss_bytes()
    trainer = build_trainer("hf_tune", data, work / "breakdown")
    model = trainer.model
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    names = {module: name for name, module in model.named_modules()}
    stack: list = []
    saved: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    squares: dict[str, int] = defaultdict(int)  # [..., seq, seq] tensors by shape: masks, or attention probabilities

    def enter(module, _args):
        stack.append(module)

    def leave(module, _args, _out):
        stack.pop()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in param_ptrs or storage.data_ptr() in seen or storage.nbytes() == 0:
            return tensor
        seen.add(storage.data_ptr())
        module = next((m for m in reversed(stack) if m in names), model)
        kind = module_kind(names.get(module, ""), module)
        saved[kind] += storage.nbytes()
        if tensor.dim() == 4 and tensor.shape[-1] == tensor.shape[-2] > 64:
            squares[f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"] += storage.nbytes()
        return tensor

    pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
    post = torch.nn.modules.module.register_module_forward_hook(leave)
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    rss_before = rss_bytes()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = trainer.compute_loss(model, batch)
    pre.remove()
    post.remove()
    rss_forward = rss_bytes()
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = batch["input_ids"].numel()
    real = int(batch["attention_mask"].sum())
    return {"tokens": tokens, "real_tokens": real, "shape": list(batch["input_ids"].shape),
            "attn": model.get_base_model().config._attn_implementation,
            "baseline": baseline, "weights": weights, "trainable": trainable, "rss_before": rss_before,
            "rss_forward": rss_forward, "peak": peak, "saved": dict(saved), "squares": dict(squares),
            "vocab": model.get_base_model().lm_head.weight.shape[0]}


def head_alone(rows: int, sequence: int) -> dict:
    """TRL's fused LM head alone (the call DPOTrainer makes: every position scored off Triton), forward and backward
    on float32 hidden states of one batch's shape: the RSS it adds over its inputs."""
    import torch
    from transformers import AutoConfig
    from trl.kernels import ChunkedLogProbFunction
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from hf_tune.model.loading import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path(MODEL))
    n = rows * (sequence - 1)
    weight = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    hidden = torch.randn(n, config.hidden_size, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (n,))
    before = rss_bytes()
    out = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                       ("log_probs", "entropy", "mean_logits", "is_top1"))
    forward = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (-out[0].sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tile = min(n, TOKEN_CHUNK_SIZE) * min(_CHUNKED_LOGPROB_CHUNK_SIZE, config.vocab_size) * 4
    return {"positions": n, "tile": tile, "tile_shape": [min(n, TOKEN_CHUNK_SIZE), _CHUNKED_LOGPROB_CHUNK_SIZE],
            "forward": forward - before, "backward": peak - before, "full_logits": n * config.vocab_size * 4}


def render_breakdown(r: dict, head: dict) -> str:
    gb = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    saved_total = sum(r["saved"].values())
    lines = [f"One step of hf_tune's DPO run, checkpointing off: batch {r['shape']} = {r['tokens']} tokens "
             f"({r['real_tokens']} not padding), attention `{r['attn']}`, fp32, LoRA r=16 all-linear.", "",
             "| what | GB |", "|---|---|",
             f"| Python, torch, transformers, TRL imported (RSS before the model) | {gb(r['baseline'])} |",
             f"| weights (fp32; LoRA {r['trainable'] / 2**20:.0f} MB of them) | {gb(r['weights'])} |",
             f"| LoRA gradients + AdamW moments (3 × the trainable weights) | {gb(3 * r['trainable'])} |"]
    for kind, size in sorted(r["saved"].items(), key=lambda kv: -kv[1]):
        note = "".join(f" (of which {shape}: {gb(size)})" for shape, size in r["squares"].items()
                       if kind.startswith("attention"))
        lines.append(f"| saved for backward: {kind}{note} | {gb(size)} |")
    lines += [f"| saved for backward, all | **{gb(saved_total)}** |",
              f"| TRL's fused head alone, RSS it adds at its forward's peak / its backward's peak (one tile "
              f"{head['tile_shape']} is {gb(head['tile'])}; the full logits would be {gb(head['full_logits'])}) "
              f"| {gb(head['forward'])} / {gb(head['backward'])} |",
              f"| RSS before the step / after the forward | {gb(r['rss_before'])} / {gb(r['rss_forward'])} |",
              f"| peak RSS of the process (ru_maxrss, after backward) | **{gb(r['peak'])}** |"]
    return "\n".join(lines)


# ---------------------------------------------------------------- driver

def run_child(*args: str) -> dict:
    """One setup in a fresh process, with a fresh reference cache (a setup must not read another's reference pass)."""
    env = {**os.environ, "HF_TUNE_CACHE": tempfile.mkdtemp(prefix="hf_tune_bench_cache_")}
    out = subprocess.run([sys.executable, __file__, "child", *args], cwd=REPO, capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["compare", "breakdown", "child"])
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--setups", default=",".join(SETUPS))
    args = parser.parse_args()
    if args.what == "child":
        kind, data = args.rest[0], Path(args.rest[1])  # "head": rows and sequence length instead of data
        work = Path(tempfile.mkdtemp(prefix="hf_tune_bench_"))
        if kind == "head":
            result = head_alone(int(args.rest[1]), int(args.rest[2]))
        else:
            result = breakdown(data, work) if kind == "breakdown" else compare_child(kind, data, work)
        print(json.dumps(result))
        return
    data = write_pairs(Path(tempfile.mkdtemp(prefix="hf_tune_dpo_data_")))
    command = "python benchmarks/dpo_memory.py " + " ".join(sys.argv[1:])
    print(f"Command: `{command}`  \nDate: {datetime.date.today()}; {platform.machine()}, {os.cpu_count()} cores, "
          f"torch threads as the process sets them\n")
    if args.what == "breakdown":
        step = run_child("breakdown", str(data))
        print(render_breakdown(step, run_child("head", *map(str, step["shape"]))))
        return
    base = None
    print("| setup | peak RSS GB | RSS × TRL | s/step | steps/s × TRL | reference pass s | epoch s | loss step 1 "
          "| loss step 4 |\n|---|---|---|---|---|---|---|---|---|")
    for setup in args.setups.split(","):
        r = run_child(setup, str(data))
        base = base or r
        print(f"| {SETUPS[setup]} | {r['peak_rss_gb']:.2f} | {r['peak_rss_gb'] / base['peak_rss_gb']:.2f} | "
              f"{r['s_per_step']:.1f} | {base['s_per_step'] / r['s_per_step']:.2f} | "
              f"{r['reference_s']:.1f} | {r['epoch_s']:.0f} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
