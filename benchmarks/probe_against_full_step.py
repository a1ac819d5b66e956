"""The activation probe's scaling against the same measurement at full shape: for a few mid-size configurations
(dense with and without activation checkpointing, a large vocabulary, a mixture of experts with LoRA on attention and
on its fused experts), the probe's estimate for one 2048-token micro-batch beside ``measure`` run on the full model
(the same CPU allocator count, so this checks the extrapolation in depth, width and tokens, not the instrument).

    python benchmarks/probe_against_full_step.py
"""

from __future__ import annotations

import torch
import transformers

from hf_tune.model import activation_probe as probe

TOKENS = 2048
LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, vocab_size=32768)
CASES = {  # name: (model class, config, checkpointing, LoRA targets)
    "llama, checkpointing": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA), True, "all-linear"),
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA), False, "all-linear"),
    "qwen3, 152k vocabulary, checkpointing": (
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
        True, "all-linear"),
}
MOE = transformers.Qwen3MoeConfig(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
                                  num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, head_dim=64, vocab_size=32768)
CASES["qwen3-moe, LoRA on attention and experts"] = (transformers.Qwen3MoeForCausalLM, MOE, False, "all-linear")
CASES["qwen3-moe, LoRA on attention"] = (transformers.Qwen3MoeForCausalLM, MOE, False,
                                         ["q_proj", "k_proj", "v_proj", "o_proj"])


def main() -> None:
    print("| case | full shape: kept / peak MB | probe: kept / peak MB | probe / full (kept, peak) |")
    print("|---|---|---|---|")
    for name, (model_class, config, checkpointing, targets) in CASES.items():
        dropout = 0.0 if "moe" in name else 0.05
        setup = probe.ProbeSetup(
            model_class=model_class, config=config, dtype=torch.bfloat16, mixed_precision=True,
            attention="sdpa_varlen", padding_free=True,
            lora={"r": 16, "lora_alpha": 32, "lora_dropout": dropout, "target_modules": targets},
            fast_lora_dropout=True, chunked_loss=True, checkpointing=checkpointing,
            checkpointing_kwargs={"use_reentrant": False})
        [(kept, _, peak)] = probe.measure(setup, config, [TOKENS], chunk_size=None)  # the real chunk of the loss
        estimate = probe.estimate_activations(setup, TOKENS)
        print(f"| {name} | {kept / 2**20:.0f} / {peak / 2**20:.0f} | {estimate.kept / 2**20:.0f} / "
              f"{estimate.peak / 2**20:.0f} | {estimate.kept / kept:.2f}, {estimate.peak / peak:.2f} |")


if __name__ == "__main__":
    main()
