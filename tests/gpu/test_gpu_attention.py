"""Per-example losses of a flattened (packed) row on a GPU, for every attention that runs examples apart, equal the
losses of each example run alone: sdpa_varlen and eager in float32, flash attention (where installed) in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

LENGTHS = [37, 5, 64, 18]


def tiny_llama(attention: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_tune.model.attention  # noqa: F401 - registers sdpa_varlen

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).to("cuda", dtype).eval()
    model.set_attn_implementation(attention)
    return model


def examples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=generator) for n in LENGTHS]


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), ids[1:].to(logits.device))


def alone(model, ids: list[torch.Tensor]) -> list[float]:
    """Each example in its own forward: no packing, no mask, nothing to get wrong."""
    with torch.no_grad():
        return [next_token_loss(model(ids[None].cuda(), use_cache=False).logits[0], ids).item() for ids in ids]


def packed(model, ids: list[torch.Tensor], tokenizer) -> list[float]:
    """One flattened row, as hf_tune's collator builds it, split back into examples after the forward."""
    from hf_tune.data.collator import CausalLMCollator

    batch = CausalLMCollator(tokenizer, padding_free=True, trainable_logits_only=False, example_boundaries=True)(
        [{"input_ids": x.tolist(), "labels": x.tolist()} for x in ids])
    batch.pop("labels")
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with torch.no_grad():
        logits = model(**batch).logits[0]
    bounds = torch.tensor([0, *LENGTHS]).cumsum(0).tolist()
    return [next_token_loss(logits[a:b], x).item() for a, b, x in zip(bounds, bounds[1:], ids)]


@pytest.mark.parametrize("attention", ["sdpa_varlen", "eager", "sdpa"])
def test_float32_packed_losses_equal_each_example_alone(attention, smol_tokenizer):
    ids = examples()
    reference = alone(tiny_llama("eager", torch.float32), ids)
    assert packed(tiny_llama(attention, torch.float32), ids, smol_tokenizer) == pytest.approx(reference, rel=1e-4)


@pytest.mark.parametrize("attention", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_packed_losses_equal_each_example_alone(attention, smol_tokenizer):
    from hf_tune.model.attention_choice import flash_candidates

    if attention not in flash_candidates(torch.cuda.get_device_capability()):
        pytest.skip(f"{attention} is not installed for this card")
    ids = examples()
    reference = alone(tiny_llama("eager", torch.bfloat16), ids)
    got = packed(tiny_llama(attention, torch.bfloat16), ids, smol_tokenizer)
    assert got == pytest.approx(reference, rel=1e-2)  # bf16: ~3 significant digits
    varlen = packed(tiny_llama("sdpa_varlen", torch.bfloat16), ids, smol_tokenizer)
    assert got == pytest.approx(varlen, rel=1e-2)


def test_the_build_chooses_an_attention_that_runs_examples_apart(tmp_path, tiny_llama_dir):
    from conftest import chat_recipe

    from hf_tune import build_model_and_tokenizer, load_recipe
    from hf_tune.model.attention import loaded_attn_implementation
    from hf_tune.model.attention_choice import flash_candidates

    model, _ = build_model_and_tokenizer(load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run")))
    installed = flash_candidates(torch.cuda.get_device_capability()) if torch.cuda.is_bf16_supported() else []
    assert loaded_attn_implementation(model) == (installed[0] if installed else "sdpa_varlen")
