"""hf-tune chat: device, dtype, greedy and sampled replies, streamed output (SmolLM2, a LoRA of the tiny Llama)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_tune.commands import cli
from hf_tune.errors import HfTuneError
from hf_tune.workflows.inference import default_device, default_dtype, load_trained, reply

QUESTION = [{"role": "user", "content": "Name a planet."}]


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, tiny_llama_dir, smol_tokenizer) -> Path:
    """A LoRA run folder of the tiny Llama with random (non-zero) factors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir),
                           LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    run = tmp_path_factory.mktemp("chat") / "run"
    model.save_pretrained(run)
    smol_tokenizer.save_pretrained(run)
    return run


def greedy_by_hand(model, tokenizer, messages, max_new_tokens: int) -> str:
    """Argmax of the last position's logits, one token at a time, until eos: what greedy decoding means."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    prompt_length = ids.shape[1]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = model(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
            if token.item() == tokenizer.eos_token_id:
                break
    return tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True).strip()


def test_defaults_on_this_machine_are_cpu_and_float32():
    if torch.cuda.is_available():
        assert default_device() == "cuda"
        assert default_dtype("cuda") == ("bfloat16" if torch.cuda.is_bf16_supported() else "float32")
    elif not torch.backends.mps.is_available():
        assert default_device() == "cpu"
    assert default_dtype("cpu") == "float32"


@pytest.mark.parametrize("run", ["full", "adapter"])
def test_the_default_reply_is_greedy(run, smol_dir, adapter_run):
    model, tokenizer = load_trained(smol_dir if run == "full" else adapter_run)
    assert model.dtype == torch.float32 and model.device.type == default_device()
    text = reply(model, tokenizer, QUESTION, max_new_tokens=12)
    assert text and text == greedy_by_hand(model, tokenizer, QUESTION, 12)


def test_seeded_sampling_repeats_and_differs_from_greedy(adapter_run):
    model, tokenizer = load_trained(adapter_run, device="cpu", dtype="float32")
    greedy = reply(model, tokenizer, QUESTION, max_new_tokens=12)
    sampled = [reply(model, tokenizer, QUESTION, max_new_tokens=12, temperature=1.0, seed=seed) for seed in (0, 0, 1)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2] and sampled[0] != greedy
    # a nucleus that holds only the most likely token leaves nothing to sample: the greedy reply
    assert reply(model, tokenizer, QUESTION, max_new_tokens=12, temperature=1.0, top_p=1e-9, seed=3) == greedy


def test_the_streamed_text_is_the_returned_text(smol_dir, capsys):
    model, tokenizer = load_trained(smol_dir, device="cpu")
    capsys.readouterr()
    text = reply(model, tokenizer, QUESTION, max_new_tokens=12, temperature=0.7, top_p=0.9, seed=0, stream=True)
    assert text and capsys.readouterr().out.strip() == text


def test_dtype_choices_load_the_weights_in_that_dtype(adapter_run):
    assert load_trained(adapter_run, device="cpu", dtype="bfloat16")[0].get_base_model().dtype == torch.bfloat16
    assert load_trained(adapter_run, device="cpu", dtype="auto")[0].get_base_model().dtype == torch.float32  # saved
    with pytest.raises(HfTuneError, match="--dtype: 'int8' is not one of auto, bfloat16"):
        load_trained(adapter_run, device="cpu", dtype="int8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_the_machine_lacks_is_refused_with_the_fix(tiny_llama_dir):
    with pytest.raises(HfTuneError, match=r"--device cuda: .*\n  fix: pass --device"):
        load_trained(tiny_llama_dir, device="cuda")


def test_the_cli_streams_a_sampled_reply(tiny_llama_dir, capsys):
    args = ["chat", tiny_llama_dir, "--prompt", "Name a planet.", "--device", "cpu", "--dtype", "float32",
            "--temperature", "0.7", "--top-p", "0.9", "--seed", "0", "--max-new-tokens", "12"]
    cli.main(args)
    out = capsys.readouterr().out
    model, tokenizer = load_trained(tiny_llama_dir, device="cpu")
    expected = reply(model, tokenizer, QUESTION, max_new_tokens=12, temperature=0.7, top_p=0.9, seed=0)
    assert out.startswith("user: Name a planet.\nassistant: ") and out.strip().endswith(expected)
