"""Padding-free packing is decided by proof (hf_tune/model/packing_probe.py): a tiny model of the architecture run
flattened and alone. Every "packs" verdict is checked here independently: hf_tune's own collator flattens three
other examples through a differently seeded model, and each example's logits must equal those of the example alone.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from conftest import REPO, chat_recipe

LENGTHS = (9, 4, 13)


def assert_flattened_examples_equal_each_alone(model_class: type, config) -> None:
    """The independent check: a model of the probe's tiny config, seeded otherwise, under sdpa_varlen; three
    examples flattened by hf_tune's collator (restarting position_ids, cu_seq_lens); each slice of the row's
    logits against the example run alone."""
    from hf_tune.data.collator import CausalLMCollator
    from hf_tune.model.attention import NAME
    from hf_tune.model.packing_probe import tiny_config

    tiny = tiny_config(config)
    torch.manual_seed(123)
    model = model_class(tiny).float().eval()
    model.set_attn_implementation(NAME)
    generator = torch.Generator().manual_seed(7)
    examples = [torch.randint(5, 200, (n,), generator=generator).tolist() for n in LENGTHS]
    batch = CausalLMCollator(None, padding_free=True, trainable_logits_only=False, example_boundaries=True)(
        [{"input_ids": ids, "labels": ids} for ids in examples])
    batch.pop("labels")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: faster on one thread
    try:
        with torch.no_grad():
            row = model(**batch).logits[0]
            alone = [model(input_ids=torch.tensor([ids]), use_cache=False).logits[0] for ids in examples]
    finally:
        torch.set_num_threads(threads)
    scale = max(float(logits.abs().max()) for logits in alone)  # float32 noise grows with the logits and the depth
    for i, expected in enumerate(alone):
        start = sum(LENGTHS[:i])
        torch.testing.assert_close(row[start:start + LENGTHS[i]], expected, rtol=0, atol=1e-4 * scale,
                                   msg=lambda m: f"{model_class.__name__}, example {i}: {m}")


def lfm2_config(layer_types: list[str], vocab_size: int = 1000):
    from transformers import Lfm2Config

    return Lfm2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=len(layer_types), layer_types=layer_types)


@pytest.mark.parametrize("class_name", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                                        "GemmaForCausalLM"])
def test_pure_attention_models_pack_padding_free(class_name):
    import transformers

    from hf_tune.model.attention import NAME, default_attn_implementation, supports_padding_free

    model_class = getattr(transformers, class_name)
    assert supports_padding_free(model_class, NAME)
    assert default_attn_implementation(True, model_class) == NAME
    assert_flattened_examples_equal_each_alone(model_class, model_class.config_class())


def test_a_hybrid_conv_model_keeps_padded_batches_and_logs_why(caplog):
    """LFM2 with its convolution layers: the convolution reads the previous example's last tokens, so a flattened
    row changes the second example's logits (checked directly below); the probe refuses, logs the reason, and
    sdpa_varlen is not the default. The same class with attention layers only packs: the user's layer kinds count."""
    from transformers import Lfm2ForCausalLM

    from hf_tune.model.attention import NAME, default_attn_implementation, supports_padding_free

    hybrid = lfm2_config(["conv", "full_attention", "conv"])
    with caplog.at_level(logging.WARNING, logger="hf_tune.model.packing_probe"):
        assert not supports_padding_free(Lfm2ForCausalLM, NAME, hybrid)
    assert "Lfm2ForCausalLM" in caplog.text and "mixes the flattened examples" in caplog.text
    assert default_attn_implementation(True, Lfm2ForCausalLM, hybrid) is None
    with pytest.raises(AssertionError):
        assert_flattened_examples_equal_each_alone(Lfm2ForCausalLM, hybrid)

    attention_only = lfm2_config(["full_attention", "full_attention"])
    assert supports_padding_free(Lfm2ForCausalLM, NAME, attention_only)
    assert_flattened_examples_equal_each_alone(Lfm2ForCausalLM, attention_only)


def test_the_verdict_is_computed_once_and_leaves_the_callers_state_alone():
    """A second question is answered from memory (the same result object); the probe neither draws from the
    caller's random generator nor keeps its single thread."""
    from transformers import LlamaForCausalLM

    from hf_tune.model.attention import NAME
    from hf_tune.model.packing_probe import probe_padding_free

    config = LlamaForCausalLM.config_class(num_hidden_layers=3)  # a config no other test probes
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    first = probe_padding_free(LlamaForCausalLM, NAME, True, config)
    assert torch.equal(torch.get_rng_state(), state) and torch.get_num_threads() == threads
    assert first.packs and first.seconds > 0
    assert probe_padding_free(LlamaForCausalLM, NAME, True, config) is first


def test_a_hybrid_recipe_loads_sdpa_and_trains_on_padded_packs(tmp_path, smol_tokenizer):
    """Through build_run: a hybrid LFM2 folder loads with transformers' SDPA (not sdpa_varlen) and its collator pads
    the packs; its flattened-row alternative is what the probe refused."""
    from transformers import Lfm2ForCausalLM

    from hf_tune import build_run, load_recipe
    from hf_tune.model.attention import NAME

    torch.manual_seed(0)
    folder = tmp_path / "tiny-lfm2"
    config = lfm2_config(["conv", "full_attention"], vocab_size=len(smol_tokenizer))
    config.pad_token_id, config.eos_token_id = smol_tokenizer.pad_token_id, smol_tokenizer.eos_token_id
    Lfm2ForCausalLM(config).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    recipe = chat_recipe(str(folder), tmp_path / "run")
    recipe["data"]["batch_tokens"] = 512
    run = build_run(load_recipe(recipe))
    assert run.model.config._attn_implementation != NAME
    batch = run.trainer.data_collator([{"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
                                       {"input_ids": [8, 9], "labels": [8, 9]}])
    assert batch["input_ids"].shape[0] == 2 and "position_ids" not in batch and "cu_seq_lens_q" not in batch


@pytest.mark.slow
def test_every_causal_lm_claiming_the_attention_backend_is_probed_and_each_packing_verdict_holds():
    """The survey behind docs/speed.md's table: every causal LM transformers ships that claims the attention
    backend, probed; each "packs" verdict checked independently; known pure-attention models pack, known hybrids
    do not; a class that cannot be built tiny on the CPU is recorded with its reason (and keeps padded batches)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from packing_probe_table import survey, table

    findings, left_out = survey()
    print(table(findings, left_out))  # the record, with -s
    for finding in findings:
        if finding.packs:
            assert_flattened_examples_equal_each_alone(finding.model_class, finding.config)
    verdicts = {(f.model_type, f.layout): f for f in findings}
    for model_type in ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3"):
        assert verdicts[model_type, "defaults"].packs, verdicts[model_type, "defaults"].reason
    assert verdicts["lfm2", "released hybrid layout"].mixes
    assert sum(f.packs for f in findings) > len(findings) // 2
