"""Token counts and model FLOPs checked against counts made by hand; a run's throughput metrics (hf_tune/trainer/throughput.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA, chat_recipe
from inputs import make_examples


def test_token_counter_counts_real_tokens_when_pad_is_eos(smol_tokenizer):
    """The trap: pad = eos, so counting tokens != pad drops every end-of-turn token. Count from the mask instead."""
    from hf_tune.data.collator import CausalLMCollator
    from hf_tune.trainer.throughput import count_batch

    eos = smol_tokenizer.eos_token_id
    assert smol_tokenizer.pad_token_id == eos
    examples = make_examples([9, 4, 15])
    for e in examples:  # every example ends on an eos that is trained, as a chat turn does
        e["input_ids"][-1] = e["labels"][-1] = eos
    real = sum(len(e["input_ids"]) for e in examples)
    trained = sum(sum(1 for label in e["labels"][1:] if label != -100) for e in examples)
    for padding_free in (True, False):
        batch = CausalLMCollator(smol_tokenizer, padding_free=padding_free, trainable_logits_only=True)(examples)
        counts = count_batch(batch)
        assert (counts.tokens, counts.trained_tokens, counts.examples) == (real, trained, 3)
        assert counts.lengths == [9, 4, 15]
        assert counts.head_positions == trained
    padded = CausalLMCollator(smol_tokenizer, padding_free=False, trainable_logits_only=True)(examples)
    assert int((padded["input_ids"] != smol_tokenizer.pad_token_id).sum()) < real  # what the naive count gets


def hand_count(config, lengths: list[int], head_positions: int, lora_r: int | None) -> float:
    """Training FLOPs of a Llama written out from its config: 2 FLOPs per weight and token forward; backward twice
    that where weights train, once where only inputs need gradients; attention QK^T and PV over causal pairs."""
    d, f, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    h, kv = config.num_attention_heads, config.num_key_value_heads
    hd = d // h
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f  # q, k, v, o, gate/up/down
    tokens = sum(lengths)
    causal_pairs = sum(n * (n + 1) / 2 for n in lengths)
    attention_fwd = L * 2 * (2 * h * hd * causal_pairs)
    linear_fwd = 2 * L * per_layer * tokens
    head_fwd = 2 * V * d * head_positions
    if lora_r is None:  # full fine-tune: every weight, the tied head included, gets gradients
        return 3 * (attention_fwd + linear_fwd + head_fwd)
    adapter = L * lora_r * ((d + h * hd) + 2 * (d + kv * hd) + (h * hd + d) + 2 * (d + f) + (f + d))
    return 3 * attention_fwd + 2 * linear_fwd + 2 * head_fwd + 3 * 2 * adapter * tokens


@pytest.mark.parametrize("lora_r", [None, 4])
def test_model_flops_equal_a_hand_count(tiny_llama_dir, lora_r):
    from transformers import AutoModelForCausalLM

    from hf_tune.trainer.throughput import model_flops

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    config = model.config
    if lora_r is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_r, target_modules="all-linear", task_type="CAUSAL_LM"))
    lengths, head_positions = [7, 30, 2], 21
    got = model_flops(model, causal=True).batch_flops(lengths, head_positions)
    assert got == pytest.approx(hand_count(config, lengths, head_positions, lora_r), rel=1e-12)


@pytest.mark.slow
def test_a_run_reports_tokens_and_throughput_in_its_metrics(tmp_path, tiny_llama_dir, smol_tokenizer):
    """One epoch over 24 chats, padded and packed: the run's token totals equal a count over the tokenized data."""
    from hf_tune import load_recipe, train
    from hf_tune.data.tokenization import tokenize_chat

    chats = [json.loads(line) for line in (DATA / "chat_demo.jsonl").read_text().splitlines()][:24]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    tokenized = [tokenize_chat(smol_tokenizer, c["messages"]) for c in chats]
    real = sum(len(ids) for ids, _ in tokenized)
    trained = sum(sum(1 for label in labels[1:] if label != -100) for _, labels in tokenized)
    recipe = chat_recipe(tiny_llama_dir, tmp_path / "run", num_train_epochs=1, max_steps=-1, logging_steps=2)
    recipe["data"].update(train={"path": str(tmp_path / "chats.jsonl")}, max_length=512, batch_tokens=512)
    train(load_recipe(recipe))
    metrics = json.loads((tmp_path / "run" / "train_results.json").read_text())
    assert metrics["train_tokens"] == real
    assert metrics["train_trained_tokens"] == trained
    assert metrics["train_tokens_per_second"] > 0 and 0 < metrics["train_mfu"] < 1
    # MFU against the theoretical peak, and against the measured matmul peak as a second figure: same FLOPs
    from hf_tune.trainer.peak_flops import measured_peak_flops, theoretical_peak_flops

    cpu = torch.device("cpu")
    ratio = measured_peak_flops(cpu, torch.float32) / theoretical_peak_flops(cpu, torch.float32)
    assert metrics["train_mfu"] / metrics["train_mfu_measured_peak"] == pytest.approx(ratio, rel=1e-9)
    assert metrics["train_peak_memory_gb"] > 0.1
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    windows = [entry for entry in history if "tokens_per_second" in entry]
    assert windows and all(w["step_time"] > 0 for w in windows)


@pytest.mark.parametrize("name, dtype, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, "highest", 989.4),   # SXM
    ("NVIDIA H100 PCIe", torch.bfloat16, "highest", 756.0),
    ("NVIDIA H200", torch.float16, "highest", 989.4),
    ("NVIDIA A100-SXM4-80GB", torch.float32, "highest", 19.5),      # fp32 FMA
    ("NVIDIA A100-SXM4-80GB", torch.float32, "high", 156.0),        # TF32 tensor cores
    ("NVIDIA A100-PCIE-40GB", torch.bfloat16, "highest", 312.0),
    ("NVIDIA A10", torch.bfloat16, "highest", 125.0),               # not the A100's
    ("NVIDIA L40S", torch.bfloat16, "highest", 362.05),             # not the L4's
    ("NVIDIA L4", torch.bfloat16, "highest", 121.0),
    ("Tesla T4", torch.float16, "highest", 65.0),
    ("Tesla T4", torch.bfloat16, "highest", None),                  # no bf16 on Turing
    ("AMD Instinct MI300X", torch.bfloat16, "highest", None),       # not in the table: no theoretical MFU
])
def test_gpu_theoretical_peaks_are_the_data_sheet_dense_figures(name, dtype, precision, tflops):
    from hf_tune.trainer.peak_flops import gpu_peak_flops

    got = gpu_peak_flops(name, dtype, precision)
    assert got == (None if tflops is None else pytest.approx(tflops * 1e12))


@pytest.mark.parametrize("flags, vendor, family, dtype, per_cycle", [
    ("sse2 avx avx2 fma avx512f", "GenuineIntel", 6, torch.float32, 2 * 16 * 2),   # 2 FMA pipes x 16 lanes x 2
    ("sse2 avx avx2 fma avx512f", "AuthenticAMD", 25, torch.float32, 2 * 8 * 2),   # Zen 4: 256-bit pipes
    ("sse2 avx avx2 fma avx512f", "AuthenticAMD", 26, torch.float32, 2 * 16 * 2),  # Zen 5: 512-bit pipes
    ("sse2 avx avx2 fma", "AuthenticAMD", 25, torch.float32, 2 * 8 * 2),           # Zen 3
    ("sse2 avx", "GenuineIntel", 6, torch.float32, 8 * 2),                         # mul + add, 8 lanes each
    ("sse2", "GenuineIntel", 6, torch.float32, 4 * 2),
    ("sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16", "GenuineIntel", 6, torch.bfloat16, 1024),  # AMX tiles
    ("sse2 avx avx2 fma avx512f avx512_bf16", "GenuineIntel", 6, torch.bfloat16, 2 * 16 * 2 * 2),  # dot of pairs
    ("sse2 avx avx2 fma", "GenuineIntel", 6, torch.bfloat16, 2 * 8 * 2),           # converted to fp32
    ("fp asimd sve", "", None, torch.float32, None),                               # not x86: unknown
])
def test_cpu_flops_per_cycle_follow_the_instruction_set(flags, vendor, family, dtype, per_cycle):
    from hf_tune.trainer.peak_flops import cpu_flops_per_cycle

    assert cpu_flops_per_cycle(set(flags.split()), vendor, family, dtype) == per_cycle


def test_this_cpus_theoretical_peak_is_cores_times_clock_times_flops_per_cycle():
    """Read back from /proc/cpuinfo here, independently: the cores the run uses, the clock, the FLOPs per cycle."""
    import re
    from pathlib import Path

    import psutil

    from hf_tune.trainer.peak_flops import cpu_flops_per_cycle, cpu_peak_flops

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = set(re.search(r"^flags\s*:(.*)$", info, re.M).group(1).split()) if "flags" in info else set()
    if "sse2" not in flags or Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").is_file() \
            or "GHz" in info.split("\n\n")[0]:
        pytest.skip("checked on an x86 host whose clock is the current one of /proc/cpuinfo")
    mhz = float(re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M).group(1))
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", info, re.M).group(1)
    family = int(re.search(r"^cpu family\s*:\s*(\d+)", info, re.M).group(1))
    cores = min(torch.get_num_threads(), psutil.cpu_count(logical=False))
    peak, how = cpu_peak_flops(torch.float32, torch.get_num_threads())
    assert peak == pytest.approx(cores * mhz * 1e6 * cpu_flops_per_cycle(flags, vendor, family, torch.float32))
    assert how.startswith(f"{cores} cores x ")


# Data-sheet dense figures (TFLOP/s), written out here from NVIDIA's data sheets: where a sheet gives only the sparse
# tensor-core figure, half of it. Device names as torch.cuda.get_device_name() reports them.
@pytest.mark.parametrize("name, dtype, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.float32, "highest", 67.0),     # SXM: FP32 67
    ("NVIDIA H100 80GB HBM3", torch.float32, "high", 989 / 2),     # TF32 989 sparse
    ("NVIDIA H100 80GB HBM3", torch.float16, "highest", 1979 / 2),
    ("NVIDIA H100 PCIe", torch.float32, "highest", 51.0),
    ("NVIDIA H100 PCIe", torch.float32, "high", 756 / 2),
    ("NVIDIA H100 PCIe", torch.float16, "highest", 1513 / 2),
    ("NVIDIA H200", torch.bfloat16, "highest", 1979 / 2),
    ("NVIDIA H200", torch.float32, "high", 989 / 2),
    ("NVIDIA H200 NVL", torch.bfloat16, "highest", 1671 / 2),      # not the SXM's
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, "highest", 312.0),
    ("NVIDIA A100 80GB PCIe", torch.float32, "high", 156.0),
    ("NVIDIA L4", torch.float32, "high", 120 / 2),
    ("NVIDIA L4", torch.float16, "highest", 242 / 2),
    ("NVIDIA L40S", torch.float32, "highest", 91.6),
    ("NVIDIA L40S", torch.float32, "high", 366 / 2),
    ("NVIDIA L40", torch.bfloat16, "highest", 362.1 / 2),           # not the L4's
    ("NVIDIA GeForce RTX 4090", torch.float32, "highest", 82.6),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, "highest", 330.4 / 2),  # FP32 accumulate: 165.2 dense
    ("NVIDIA GeForce RTX 4090", torch.float32, "high", 165.2 / 2),
    ("NVIDIA B200", torch.bfloat16, "highest", 36000 / 8 / 2),      # HGX B200: 36 PFLOPS sparse over 8 GPUs
    ("NVIDIA B200", torch.float32, "high", 18000 / 8 / 2),
    ("NVIDIA B200", torch.float32, "highest", 600 / 8),
    ("NVIDIA GB200", torch.bfloat16, "highest", 360000 / 72 / 2),   # NVL72: 360 PFLOPS sparse over 72 GPUs
])
def test_gpu_peaks_of_current_cards_match_their_data_sheets(name, dtype, precision, tflops):
    from hf_tune.trainer.peak_flops import gpu_peak_flops

    assert gpu_peak_flops(name, dtype, precision) == pytest.approx(tflops * 1e12, rel=2e-3)
