"""Peak memory of `hf-tune merge` by shard against PEFT's whole-model merge, on a random model of 0.5B+ parameters.

    flock -x /tmp/hftune.lock .venv/bin/python benchmarks/merge_by_shard.py [--shard-size 200MB] [--check]

A random Llama (SmolLM2's vocabulary, untied, bfloat16) is saved in several safetensors shards into a temporary folder,
with a random LoRA adapter (r=16) on every linear layer of its blocks. Each merge then runs in a fresh subprocess,
one at a time: hf_tune's merge by shard, and PEFT's merge_and_unload of the whole model (the path hf_tune took before,
and still takes for LoRA variants). Each child reports its own peak RSS (resource.getrusage, ru_maxrss) and its RSS
after the imports, before the merge starts. The peak is /proc/self/status VmHWM: Linux carries the spawning process's
peak into a child's ru_maxrss at exec, so the model is built in its own process and ru_maxrss is shown beside it.
Prints a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2 ** 30
CHILD = """
import json, resource, sys, time
from pathlib import Path
import torch, transformers, peft, safetensors  # imported before the floor is read: every path pays for them
import hf_tune.workflows.hub as hub
import hf_tune.model.merge

def status(field):  # VmRSS: now; VmHWM: the peak of this process's own memory since its exec
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

run, out, path, dtype, check = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "check"
torch.set_num_threads(2)
if path == "peft":
    hub._shard_plan = lambda *args: None  # the whole-model merge through PEFT, as before the merge by shard
floor = status("VmRSS")
start = time.perf_counter()
result = hub.merge(run, out, dtype=dtype, check=check)
seconds = time.perf_counter() - start
print(json.dumps({"peak_rss": status("VmHWM"), "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "floor_rss": floor,
                  "seconds": seconds, "streamed": "streamed" in result,
                  "relative_diff": result.get("relative_diff")}))
"""


def build(folder: Path, shard_size: str, layers: int) -> tuple[Path, int, int]:
    """(run folder, parameters, bytes of the base's shards): a random bfloat16 Llama and a random LoRA run of it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_tune.model.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("embedded:SmolLM2-135M-Instruct"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    base, run = folder / "base", folder / "run"
    model.save_pretrained(base, max_shard_size=shard_size)
    tokenizer.save_pretrained(base)
    lora = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    lora.save_pretrained(run)
    tokenizer.save_pretrained(run)
    adapter_config = json.loads((run / "adapter_config.json").read_text())
    (run / "adapter_config.json").write_text(json.dumps({**adapter_config, "base_model_name_or_path": str(base)}))
    return run, parameters, sum(f.stat().st_size for f in base.glob("*.safetensors"))


def merge_in_child(run: Path, out: Path, path: str, dtype: str, check: bool) -> dict:
    command = [sys.executable, "-c", CHILD, str(run), str(out), path, dtype, "check" if check else "no"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{path} merge failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["out_bytes"] = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    result["out_shards"] = len(list(out.glob("model*.safetensors")))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shard-size", default="200MB", help="max_shard_size of the saved base")
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--check", action="store_true", help="also merge with --check (reference logits)")
    parser.add_argument("--build", default=None, help=argparse.SUPPRESS)  # the model, built in its own process
    args = parser.parse_args()
    if args.build:
        run, parameters, base_bytes = build(Path(args.build), args.shard_size, args.layers)
        print(json.dumps([str(run), parameters, base_bytes]))
        return
    with tempfile.TemporaryDirectory(prefix="hf_tune-merge-bench-") as scratch:
        built = subprocess.run([sys.executable, __file__, "--build", scratch, "--shard-size", args.shard_size,
                                "--layers", str(args.layers)], cwd=ROOT, capture_output=True, text=True, check=True)
        run, parameters, base_bytes = json.loads(built.stdout.strip().splitlines()[-1])
        run = Path(run)
        shards = len(list((Path(scratch) / "base").glob("*.safetensors")))
        largest = max(f.stat().st_size for f in (Path(scratch) / "base").glob("*.safetensors"))
        adapter = (run / "adapter_model.safetensors").stat().st_size
        rows = []
        for path in ("shards", "peft"):
            for check in (False, True) if args.check else (False,):
                result = merge_in_child(run, Path(scratch) / f"merged-{path}-{check}", path, args.dtype, check)
                rows.append((path, check, result))
    print(f"\nmodel: random Llama, {parameters / 1e9:.3f}B parameters, bfloat16, {base_bytes / GIB:.2f} GiB in "
          f"{shards} shards (largest {largest / GIB:.2f} GiB); adapter r=16 on all linear layers, {adapter / 2**20:.0f}"
          f" MiB; merged to {args.dtype}; {platform.processor() or platform.machine()}, torch threads 2\n")
    print("| merge | --check | peak RSS (GiB) | RSS after imports (GiB) | peak - imports (GiB) | peak / model size "
          "| ru_maxrss (GiB) | time (s) | output shards |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path, check, r in rows:
        name = "by shard (hf_tune)" if path == "shards" else "whole model (PEFT merge_and_unload)"
        assert r["streamed"] == (path == "shards"), r
        print(f"| {name} | {'yes' if check else 'no'} | {r['peak_rss'] / GIB:.2f} | {r['floor_rss'] / GIB:.2f} | "
              f"{(r['peak_rss'] - r['floor_rss']) / GIB:.2f} | {r['peak_rss'] / base_bytes:.2f} | "
              f"{r['ru_maxrss'] / GIB:.2f} | {r['seconds']:.1f} | {r['out_shards']} |")


if __name__ == "__main__":
    main()
