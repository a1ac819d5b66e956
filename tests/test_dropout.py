"""FastDropout is inverted dropout: the right drop rate in every position, the right scale, the right gradient,
reproducible under a seed; LoRA layers built from a recipe get it (or PEFT's nn.Dropout when turned off)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DATA
from torch import nn

from hf_tune import build_model_and_tokenizer, load_recipe
from hf_tune.model.dropout import FastDropout


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_drop_rate_and_scale_match_dropout_in_every_position(p):
    torch.manual_seed(0)
    x = torch.ones(2000, 1001)  # odd width: positions fall in every 16-bit lane of the 64-bit draws
    out = FastDropout(p).train()(x)
    dropped = out == 0
    n_per_lane = x.numel() / 4
    sigma = math.sqrt(p * (1 - p) / n_per_lane)
    lanes = torch.arange(x.numel()).view(x.shape) % 4
    for lane in range(4):
        assert abs(dropped[lanes == lane].float().mean().item() - p) < 5 * sigma + 1 / 65536
    kept = out[~dropped]
    assert torch.allclose(kept, torch.full_like(kept, 1 / (1 - p)), rtol=2e-5)  # p is rounded to 1/65536 at most
    assert abs(out.mean().item() - 1.0) < 5 * sigma / (1 - p) * 2


def test_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(1)
    x = torch.randn(64, 128, requires_grad=True)
    out = FastDropout(0.2).train()(x)
    out.sum().backward()
    mask = (out != 0).float()
    assert 0.7 < mask.mean().item() < 0.9
    assert torch.allclose(x.grad, mask / (1 - 0.2), rtol=1e-5)
    assert torch.allclose(out, x.detach() * mask / (1 - 0.2), rtol=1e-5)


def test_eval_mode_and_zero_p_are_the_identity_and_seeds_reproduce():
    x = torch.randn(8, 16)
    assert FastDropout(0.3).eval()(x) is x
    assert FastDropout(0.0).train()(x) is x
    drop = FastDropout(0.3).train()
    torch.manual_seed(7)
    first = drop(x)
    torch.manual_seed(7)
    assert torch.equal(drop(x), first)
    assert not torch.equal(drop(x), first)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        FastDropout(1.0)


def lora_recipe(tiny_llama_dir: str, **model_keys):
    return load_recipe({"model": {"pretrained_model_name_or_path": tiny_llama_dir, **model_keys},
                        "lora": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": "all-linear"},
                        "data": {"train": {"path": str(DATA / "chat_demo.jsonl")}}})


def test_lora_layers_from_a_recipe_get_fast_dropout_unless_turned_off(tiny_llama_dir):
    fast, _ = build_model_and_tokenizer(lora_recipe(tiny_llama_dir))
    plain, _ = build_model_and_tokenizer(lora_recipe(tiny_llama_dir, fast_lora_dropout=False))
    lora_layers = [m for m in fast.modules() if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict)]
    assert lora_layers and all(type(m.lora_dropout["default"]) is FastDropout and m.lora_dropout["default"].p == 0.1
                               for m in lora_layers)
    assert all(type(m.lora_dropout["default"]) is nn.Dropout for m in plain.modules()
               if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict))
    assert fast.state_dict().keys() == plain.state_dict().keys()  # nothing added to what is saved
