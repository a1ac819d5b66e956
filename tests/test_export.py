"""hf-tune export: the GGUF read back by transformers' GGUF loader holds the merged weights (rounded to the file's
type, computed here), so its logits are the merged model's; the tokenizer and chat template travel; Ollama's template
renders what the run's Jinja template renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from chat_templates import family_tokenizer
from safetensors.torch import load_file

from hf_tune.errors import HfTuneError
from hf_tune.model.ollama_template import turn_parts
from hf_tune.workflows.export import export

DEMO_CHATS = Path(__file__).parent.parent / "examples" / "data" / "chat_demo.jsonl"
IDS = torch.tensor([[1, 20, 300, 4000, 17, 9]])


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, smol_tokenizer) -> Path:
    """A LoRA run (random factors on every linear layer) of a 2-layer Llama whose head is not tied."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         pad_token_id=smol_tokenizer.pad_token_id, eos_token_id=smol_tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(root / "base", max_shard_size="200KB")
    smol_tokenizer.save_pretrained(root / "base")
    model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"),
                           LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    model.save_pretrained(root / "run")
    smol_tokenizer.save_pretrained(root / "run")
    return root / "run"


def read_back(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32),
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))


def rounded(tensor: torch.Tensor, quant: str) -> torch.Tensor:
    """What the file stores: 1-D tensors float32, 2-D ones as f16 / bf16, or Q8_0 blocks of 32 values, each
    round(x / d) (half away from zero) as int8 with d = max |x| / 127 kept as float16 (ggml's definition), written
    here from the format's definition."""
    if tensor.dim() == 1:
        return tensor
    if quant in ("f16", "bf16"):
        return tensor.to(torch.float16 if quant == "f16" else torch.bfloat16).float()
    blocks = tensor.reshape(-1, 32).float()
    scale = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(scale == 0, 0.0, 1 / scale)
    values = torch.sign(blocks * inverse) * torch.floor((blocks * inverse).abs() + 0.5)
    return (scale.to(torch.float16).float() * values).reshape(tensor.shape)


@pytest.fixture(scope="module")
def merged_weights(adapter_run, tmp_path_factory) -> dict[str, torch.Tensor]:
    """hf-tune merge's float32 tensors (tests/test_merge.py checks them against W + scale * B @ A)."""
    from hf_tune.workflows.merge_run import merge

    folder = Path(merge(adapter_run, out=tmp_path_factory.mktemp("merged") / "merged")["merged_dir"])
    weights = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


@pytest.fixture(scope="module")
def base_and_adapter_logits(adapter_run) -> torch.Tensor:
    from peft import AutoPeftModelForCausalLM

    reference = AutoPeftModelForCausalLM.from_pretrained(adapter_run, dtype=torch.float32).eval()
    with torch.no_grad():
        return reference(IDS).logits


@pytest.mark.parametrize("quant", ["f16", "bf16", "q8_0"])
def test_a_lora_run_reads_back_as_its_merged_model(quant, adapter_run, merged_weights, base_and_adapter_logits,
                                                   tmp_path):
    out = tmp_path / "model.gguf"
    result = export(adapter_run, quant=quant, out=out)
    assert result["architecture"] == "llama" and out.is_file() and not list(tmp_path.glob(".*"))  # no merge left
    model, _ = read_back(out)
    loaded = model.state_dict()
    assert set(loaded) == set(merged_weights)
    for name, weight in merged_weights.items():  # the rotary permutation undone by the loader: every value in place
        assert torch.equal(loaded[name], rounded(weight.float(), quant)), name
    with torch.no_grad():
        logits = model(IDS).logits
    expected = base_and_adapter_logits
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error < {"f16": 2e-3, "bf16": 2e-2, "q8_0": 2e-2}[quant]


def test_the_tokenizer_and_chat_template_travel(adapter_run, smol_tokenizer, tmp_path):
    out = tmp_path / "model.gguf"
    export(adapter_run, out=out)
    _, tokenizer = read_back(out)
    assert tokenizer.chat_template == smol_tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.bos_token) == (smol_tokenizer.eos_token, smol_tokenizer.bos_token)
    chats = [json.loads(line)["messages"] for line in DEMO_CHATS.read_text().splitlines()[:40]]
    for messages in chats:
        assert tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"] == \
            smol_tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]


def test_the_embedded_base_matches_llama_cpps_own_conversion(smol_dir, tmp_path):
    """Exported untrained, SmolLM2 carries the metadata and vocabulary llama.cpp's converter wrote into the GGUF file
    the package ships (read here with gguf's reader): the same hyperparameters, tokens, types, merges and template."""
    import gguf

    from hf_tune.model.embedded import EMBEDDED_MODELS, locate_embedded

    (tmp_path / "recipe.yaml").write_text("model:\n  pretrained_model_name_or_path: embedded:SmolLM2-135M-Instruct\n")
    run = tmp_path / "run"
    run.mkdir()
    for file in Path(smol_dir).iterdir():
        (run / file.name).symlink_to(file)
    (run / "recipe.yaml").symlink_to(tmp_path / "recipe.yaml")
    result = export(run, out=tmp_path / "smol.gguf")
    _, spec, package = locate_embedded("embedded:SmolLM2-135M-Instruct")
    shipped = gguf.GGUFReader(package / EMBEDDED_MODELS["SmolLM2-135M-Instruct"].gguf_file).fields
    ours = gguf.GGUFReader(tmp_path / "smol.gguf").fields
    same = [key for key in shipped if key.startswith(("llama.", "tokenizer."))]
    assert len(same) >= 20 and result["pre_tokenizer"] == "smollm"
    for key in same:
        assert ours[key].contents() == shipped[key].contents(), key


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_read_back_exactly(family, smol_tokenizer, tmp_path):
    """Qwen2's attention biases and Qwen3's q / k norms, each a tensor of its own in the file. The Qwen3's heads
    are 128 wide, as every Qwen3's are (transformers reads no head width from the file and assumes 128), and wider
    than hidden_size / heads, so the file carries attention.key_length for llama.cpp."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    config_class = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    torch.manual_seed(0)
    config = config_class(vocab_size=len(smol_tokenizer), hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          tie_word_embeddings=True, eos_token_id=smol_tokenizer.eos_token_id,
                          **({"head_dim": 128} if family == "qwen3" else {}))
    folder = tmp_path / family
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    export(folder, out=tmp_path / "model.gguf")
    model, _ = read_back(tmp_path / "model.gguf")
    stored = load_file(folder / "model.safetensors")
    assert model.config.model_type == family and set(model.state_dict()) >= set(stored)
    if family == "qwen3":
        import gguf

        assert gguf.GGUFReader(tmp_path / "model.gguf").fields["qwen3.attention.key_length"].contents() == 128
    for name, weight in stored.items():
        assert torch.equal(model.state_dict()[name], rounded(weight, "f16")), name


def test_ollama_gets_a_modelfile_whose_template_is_the_runs(adapter_run, tmp_path):
    result = export(adapter_run, format="ollama", out=tmp_path / "model.gguf")
    text = Path(result["modelfile"]).read_text()
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert text == (  # ChatML, as SmolLM2's template writes it, with its default system prompt
        'FROM ./model.gguf\nTEMPLATE """{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ else }}'
        f'<|im_start|>system\n{default_system}<|im_end|>\n{{{{ end }}}}{{{{ range .Messages }}}}'
        '{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n{{ else if eq .Role "assistant" }}'
        '<|im_start|>assistant\n{{ .Content }}<|im_end|>\n{{ end }}{{ end }}<|im_start|>assistant\n"""\n'
        'PARAMETER stop "<|im_start|>"\nPARAMETER stop "<|im_end|>"\n')


@pytest.mark.parametrize("family", ["LLAMA3", "QWEN2_5"])
def test_fixed_turn_templates_are_read_off(family, smol_tokenizer):
    tokenizer = family_tokenizer(smol_tokenizer, family)
    parts = turn_parts(tokenizer)
    messages = [("system", "S"), ("user", "U"), ("assistant", "A"), ("user", "V")]
    assert parts.render(messages) == tokenizer.apply_chat_template(
        [{"role": role, "content": content} for role, content in messages], tokenize=False,
        add_generation_prompt=True)


@pytest.mark.parametrize("family, why", [("QWEN3", "changes the text of earlier ones"),
                                         ("MISTRAL", "it refuses ['system', 'user']")])
def test_templates_ollama_cannot_carry_are_refused(family, why, smol_tokenizer):
    with pytest.raises(HfTuneError, match="no Ollama template reproduces it") as caught:
        turn_parts(family_tokenizer(smol_tokenizer, family))
    assert why in str(caught.value) and "--jinja" in str(caught.value)


def test_what_gguf_cannot_hold_exactly_is_refused_by_name(smol_tokenizer, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=len(smol_tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        tmp_path / "gpt2")
    smol_tokenizer.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(HfTuneError, match="(?s)model_type 'gpt2'.*convert_hf_to_gguf.py"):
        export(tmp_path / "gpt2", out=tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
