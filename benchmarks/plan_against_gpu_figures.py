"""`plan` against peak memory measured on a GPU: the recipes of benchmarks/gpu_sft_throughput.py, planned on this
machine (no GPU needed), beside the `max_memory_allocated` benchmarks/RESULTS.md recorded for them.

    python benchmarks/plan_against_gpu_figures.py

The model folder is the benchmark's (a random-init Llama: 18 layers, hidden 1,536, GQA 12/4, SmolLM2's tokenizer),
written with its config and tokenizer only, since plan reads no weight; the data is the benchmark's 2,000 chats.
Allocated memory holds model states and activations but not the CUDA runtime, so it is compared with plan's peak
per rank less its runtime reserve.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_sft_throughput import TOKENIZER, recipe_dict  # noqa: E402
from sft_throughput import write_data  # noqa: E402

# (setup, card, peak allocated GB) as benchmarks/RESULTS.md "SFT throughput on a GPU" records them: the H100's
# "hf_tune GPU defaults" ran before the chunked loss was a default, so it is the unchunked setup; the H200's chunked
# figure is of the chunked loss's earlier form (logits recomputed in backward; today's keeps the hidden-state gradient)
MEASURED = [("hf_tune_unchunked", "H100", 16.6), ("hf_tune_unchunked", "H200", 16.6), ("hf_tune_chunked", "H200", 14.2)]


def model_folder(folder: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig

    from hf_tune.model.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path(TOKENIZER))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=1536, intermediate_size=1536 * 8 // 3,
                         num_hidden_layers=18, num_attention_heads=12, num_key_value_heads=4,
                         max_position_embeddings=4096, tie_word_embeddings=True, dtype="bfloat16",
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> None:
    from hf_tune import load_recipe
    from hf_tune.model.memory import RUNTIME_RESERVE_BYTES
    from hf_tune.workflows.plan import plan

    work = HERE.parent / "runs" / "plan_against_gpu"
    train, _ = write_data(work / "data", 2000)
    folder = model_folder(work / "model")
    print("| setup | card | measured allocated GB | plan: states + activations GB | plan / measured | "
          "activations kept / peak GB |")
    print("|---|---|---|---|---|---|")
    for setup, card, measured in MEASURED:
        raw = recipe_dict(folder, train, work / setup, setup)
        raw["training"]["bf16"] = True  # the GPU run's default (hf_tune turns bf16 on where the card has it)
        result = plan(load_recipe(raw), out_dir=work / setup)
        planned = (result["peak_per_rank"] - RUNTIME_RESERVE_BYTES) / 2**30
        act = result["activations"]
        print(f"| {setup} | {card} | {measured:.1f} | {planned:.2f} | {planned / measured:.2f} | "
              f"{act['bytes'] / 2**30:.2f} / {act['peak_bytes'] / 2**30:.2f} |")


if __name__ == "__main__":
    main()
