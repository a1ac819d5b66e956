"""hf-tune generate and serve on a LoRA run of SmolLM2: batched answers and the server's (through the real openai
client, the server started and stopped here) equal chat's greedy replies, prompt by prompt."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port

from hf_tune.errors import HfTuneError
from hf_tune.records.run_reader import open_run
from hf_tune.workflows.generate import generate_file, read_prompts
from hf_tune.workflows.inference import load_trained, reply
from hf_tune.workflows.serve import serve, vllm_command

PROMPTS = [
    {"prompt": "What is the capital of Norway?"},
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "What colour is the sky on a clear day?"}]},
    {"prompt": "Name a prime number.", "id": 3},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Tell me a fact about the Moon."}]},
    {"prompt": "2 + 2 ="},
]
TOKENS = 16


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory, smol_dir) -> Path:
    """A LoRA run of SmolLM2 whose factors are small and random (a trained adapter's scale)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(smol_dir),
                           LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    run = tmp_path_factory.mktemp("serving") / "smol-lora"
    model.save_pretrained(run)
    AutoTokenizer.from_pretrained(smol_dir).save_pretrained(run)
    return run


@pytest.fixture(scope="module")
def chat_answers(adapter_run) -> list[str]:
    """hf-tune chat's greedy reply to each prompt, one prompt at a time."""
    model, tokenizer = load_trained(adapter_run)
    conversations = [row.get("messages") or [{"role": "user", "content": row["prompt"]}] for row in PROMPTS]
    return [reply(model, tokenizer, messages, max_new_tokens=TOKENS) for messages in conversations]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_batched_answers_equal_chats_greedy_ones(adapter_run, chat_answers, tmp_path):
    out = tmp_path / "answers.jsonl"
    result = generate_file(adapter_run, write_jsonl(tmp_path / "prompts.jsonl", PROMPTS), out, batch_size=2,
                           max_new_tokens=TOKENS)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["answers"] == 5 and not (tmp_path / "answers.jsonl.partial").exists()
    assert [{k: v for k, v in line.items() if k != "answer"} for line in lines] == PROMPTS  # inputs kept, in order
    assert [line["answer"] for line in lines] == chat_answers and len(set(chat_answers)) == 5


def test_an_interrupted_file_continues_after_its_last_whole_line(adapter_run, chat_answers, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "answers.jsonl"
    answered = [json.dumps({**row, "answer": answer}) for row, answer in zip(PROMPTS[:3], chat_answers)]
    (tmp_path / "answers.jsonl.partial").write_text("\n".join(answered) + "\n" + answered[0][:20])  # cut short
    result = generate_file(adapter_run, prompts, out, batch_size=4, max_new_tokens=TOKENS)
    assert result["resumed_after"] == 3
    assert [json.loads(line)["answer"] for line in out.read_text().splitlines()] == chat_answers
    (tmp_path / "other.jsonl.partial").write_text(json.dumps({"prompt": "something else", "answer": "x"}) + "\n")
    with pytest.raises(HfTuneError, match="answers another input file"):
        generate_file(adapter_run, prompts, tmp_path / "other.jsonl")


@pytest.mark.parametrize("line, problem", [
    ("{not json", "line 2: not JSON"),
    ('{"text": "hi"}', 'line 2: needs "prompt"'),
    ('{"messages": [{"role": "user"}]}', 'line 2: needs "prompt"'),
])
def test_a_malformed_prompt_file_is_refused_by_line(line, problem, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(HfTuneError, match=problem):
        read_prompts(path)


def test_the_server_answers_as_chat_does(adapter_run, chat_answers):
    import openai

    port = free_port()
    server, model = serve(adapter_run, port=port, block=False)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for _ in range(120):  # the thread binds the port within moments
            try:
                assert model in [entry.id for entry in client.models.list().data]
                break
            except openai.APIConnectionError:
                time.sleep(0.25)
        assert Path(model) == adapter_run / "merged"  # the adapter merged once, beside it
        for row, expected in zip(PROMPTS[:2], chat_answers):
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=TOKENS)
            assert answer.choices[0].message.content.strip() == expected
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]["prompt"]}],
                                                temperature=0, max_tokens=TOKENS, stream=True)
        chunks = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
        assert len([chunk for chunk in chunks if chunk]) > 1 and "".join(chunks).strip() == chat_answers[0]
    finally:
        server.kill_server()


def test_a_run_that_is_not_a_causal_lm_is_refused_before_serving(adapter_run, tmp_path):
    run = tmp_path / "classifier"
    run.mkdir()
    for file in adapter_run.iterdir():
        if file.is_file():
            (run / file.name).symlink_to(file)
    (run / "recipe.yaml").write_text("model:\n  task: sequence_classification\n")
    with pytest.raises(HfTuneError, match="a sequence_classification run.*serve answers with a causal LM"):
        serve(run, port=free_port(), block=False)


def test_vllm_gets_the_base_the_adapter_and_the_runs_template(adapter_run, smol_dir):
    command = vllm_command(open_run(adapter_run), "0.0.0.0", 8011)
    assert command[:3] == ["vllm", "serve", smol_dir] and "--enable-lora" in command
    assert command[command.index("--lora-modules") + 1] == f"smol-lora={adapter_run}"
    assert command[command.index("--chat-template") + 1] == str(adapter_run / "chat_template.jinja")
    assert int(command[command.index("--max-lora-rank") + 1]) >= 8 and command[-4:] == ["--host", "0.0.0.0",
                                                                                        "--port", "8011"]
