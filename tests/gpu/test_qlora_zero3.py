"""ZeRO-3 QLoRA on GPUs as PEFT documents it: a 4-bit NF4 base stored in bfloat16 (``bnb_4bit_quant_storage`` =
``model.dtype``) is partitioned by DeepSpeed over the GPUs at hand (2 where there are 2), trains its adapter in bf16
with a finite loss, and the saved adapter reloads onto a freshly quantized base. tests/test_qlora.py runs the same
setup on CPU (float32 storage)."""

from __future__ import annotations

import json
import math

import launch
import pytest
import torch
import yaml
from conftest import REPO, chat_recipe

pytestmark = pytest.mark.gpu

STORED = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
          "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "bfloat16"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_zero3_qlora_partitions_a_bf16_stored_4bit_base_and_saves_a_reloadable_adapter(tmp_path, tiny_llama_dir):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("deepspeed")
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_tune.model.quantization import bitsandbytes_config

    gpus = min(2, torch.cuda.device_count())
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=4, deepspeed="zero3", bf16=True, learning_rate=1e-2)
    raw["model"].update(dtype="bfloat16", quantization_config=dict(STORED))
    raw["lora"] = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "lora_dropout": 0.0}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    result = launch.run(*launch.deepspeed(gpus, str(REPO / "tests" / "qlora_zero3_probe.py"), str(recipe),
                                          str(tmp_path / "report")), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.rank0").read_text())
    assert report["engine"] == "DeepSpeedEngine" and report["weights"]
    for name, weight in report["weights"].items():  # packed 4-bit weights held as bf16 shards, 1/gpus each
        assert weight["dtype"] == "torch.bfloat16" and weight["shard"] == -(-weight["full"] // gpus), name
    assert len(report["losses"]) == 4 and all(math.isfinite(loss) for loss in report["losses"])

    adapter = load_file(tmp_path / "run" / "adapter_model.safetensors")
    assert adapter and all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=bitsandbytes_config(STORED),
                                                dtype=torch.bfloat16, device_map={"": 0})
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 2]], device="cuda")
    with torch.no_grad():
        before = base(input_ids=ids).logits.float()
        after = PeftModel.from_pretrained(base, tmp_path / "run").eval()(input_ids=ids).logits.float()
    assert torch.isfinite(after).all() and not torch.allclose(after, before)
