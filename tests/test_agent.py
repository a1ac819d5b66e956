"""GRPO with tools and environments (the recipe's ``agent`` section): each bad input refused by name before the model
loads; a tool that raises, hangs or returns a non-string becomes a tool error, never a crash; and real multi-turn
rollouts of two tiny families (Llama, Qwen3) that call the tool: no token of a tool's result trained (the mask
rebuilt from the rollout's text), the token stream equal to the chat template's rendering of the final conversation,
each concurrent rollout with its own environment instance."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from inputs import method_recipe

from hf_tune import load_recipe
from hf_tune.assembly.run_build import build_run
from hf_tune.catalog.agents import ToolTimeout, guarded
from hf_tune.catalog.late_bound import resolve
from hf_tune.errors import RecipeError

TOOLS_MODULE = '''
import threading, time

def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


def untyped(a, b):
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return str(a + b)


class Lockers:
    def reset(self, locker, **columns):
        self.asked, self.calls = int(locker), []

    def lookup(self, locker: int) -> str:
        """Read the code of a locker.

        Args:
            locker: the locker's number
        """
        self.calls.append(int(locker))
        return f"locker {int(locker)}: code K{int(locker) * 7}Q"

    def get_reward(self) -> float:
        return float(self.asked in self.calls)


class NoReset:
    def lookup(self, locker: int) -> str:
        """Read the code of a locker.

        Args:
            locker: the locker's number
        """
        return "x"
'''


@pytest.fixture
def agent_tools(tmp_path, monkeypatch):
    (tmp_path / "agent_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("agent_tools", None)
    resolve.cache_clear()  # the next test's agent_tools is another module


def prompts_file(tmp_path, lockers=(7, 11), environment=None):
    rows = [{"prompt": [{"role": "user", "content": f"What is the code of locker {n}?"}], "locker": n,
             **({"environment": environment} if environment else {})} for n in lockers]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def agent_recipe(tmp_path, model, agent, **training):
    raw = method_recipe("grpo", model, prompts_file(tmp_path), tmp_path / "run", lora=False, num_generations=2,
                        max_completion_length=96, beta=0.0, **training)
    raw["agent"], raw["data"]["chat_template"] = agent, "qwen2_5"
    return raw


@pytest.mark.parametrize("agent, training, key, words", [
    ({"tools": ["agent_tools:nothing_here"]}, {}, "agent.tools[0]", "cannot be imported"),
    ({"tools": ["agent_tools:untyped"]}, {}, "agent.tools[0]", "cannot be described"),
    ({"environment": "agent_tools:NoReset"}, {}, "agent.environment", "no reset"),
    ({"environment": "agent_tools:Lockers"}, {"max_tool_calling_iterations": -1},
     "training.max_tool_calling_iterations", "1 or more"),
    ({}, {}, "agent", "no tool and no environment"),
])
def test_each_bad_agent_input_is_refused_by_name_when_the_recipe_loads(agent_tools, tmp_path, tiny_llama_dir, agent,
                                                                       training, key, words):
    with pytest.raises(RecipeError) as caught:
        load_recipe(agent_recipe(tmp_path, tiny_llama_dir, agent, **training))
    assert caught.value.key == key and words in str(caught.value), str(caught.value)


def test_agent_needs_a_method_that_runs_tools_and_a_reward(agent_tools, tmp_path, tiny_llama_dir):
    raw = agent_recipe(tmp_path, tiny_llama_dir, {"tools": ["agent_tools:add"]})
    raw["method"], raw["rewards"] = "rloo", ["agent_tools:add"]
    with pytest.raises(RecipeError, match="runs no tools") as caught:
        load_recipe(raw)
    assert "method: grpo" in caught.value.fix
    raw = agent_recipe(tmp_path, tiny_llama_dir, {"tools": ["agent_tools:add"]})
    with pytest.raises(RecipeError, match="no environment defines get_reward"):
        load_recipe(raw)


def test_a_template_without_a_tool_format_and_an_unknown_environment_name_are_refused_before_the_model(
        agent_tools, tmp_path, tiny_llama_dir):
    raw = agent_recipe(tmp_path, tiny_llama_dir, {"environment": "agent_tools:Lockers"})
    del raw["data"]["chat_template"]  # the tiny model's tokenizer is SmolLM2's: ChatML that renders no tool call
    with pytest.raises(RecipeError, match="cannot render an assistant's tool call") as caught:
        build_run(load_recipe(raw))
    assert caught.value.key == "data.chat_template" and "qwen2_5" in caught.value.fix
    raw = agent_recipe(tmp_path, tiny_llama_dir, {"environment": {"lockers": "agent_tools:Lockers"}})
    raw["data"]["train"]["path"] = str(prompts_file(tmp_path, environment="vault"))
    with pytest.raises(RecipeError, match=r"names \['vault'\]") as caught:
        build_run(load_recipe(raw))
    assert caught.value.key == "agent.environment"


def test_a_tool_that_raises_hangs_or_returns_a_non_string_raises_in_the_call_and_keeps_its_schema():
    from transformers.utils import get_json_schema

    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "done"

    def number(x: int) -> str:
        """A number.

        Args:
            x: it
        """
        return x

    assert get_json_schema(guarded(slow, 0.2)) == get_json_schema(slow)  # the model sees the same tool
    assert guarded(slow, 1.0)(0.01) == "done"
    started = time.monotonic()
    with pytest.raises(ToolTimeout, match="ran past 0.2 s"):
        guarded(slow, 0.2)(5)
    assert time.monotonic() - started < 2
    with pytest.raises(TypeError, match="returned int, not a string"):
        guarded(number, 1.0)(3)
    with pytest.raises(ZeroDivisionError):
        guarded(lambda: 1 / 0, 1.0)()


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True, "rope_theta": 10000.0}


def taught_to_call(folder, family: str, tmp_path) -> str:
    """A tiny model of ``family`` trained (plain PyTorch, on the chat template's text) to answer the prompt of
    locker 7 by calling lookup, then to answer with the code; saved with the tokenizer that renders it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from hf_tune.assembly.run_build import build_tokenizer
    from hf_tune.catalog.agents import guarded_environment

    recipe = load_recipe(agent_recipe(tmp_path, "embedded:SmolLM2-135M-Instruct", {"environment": "agent_tools:Lockers"}))
    tokenizer = build_tokenizer(recipe)  # SmolLM2's, with the qwen2_5 template's markers added
    import agent_tools

    tools = [guarded_environment(agent_tools.Lockers, 10).lookup]
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"locker": 7}}}
    conversation = [{"role": "user", "content": "What is the code of locker 7?"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "name": "lookup", "content": "locker 7: code K49Q"},
                    {"role": "assistant", "content": "The code is K49Q."}]
    render = {"tools": tools, "tokenize": True, "return_dict": True, "return_tensors": "pt"}  # its own template
    ids = tokenizer.apply_chat_template(conversation, **render)["input_ids"]
    prompt = tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True, **render)["input_ids"]
    labels = ids.clone()
    labels[:, :prompt.shape[1]] = -100  # the replies only: the long tool preamble need not be learnt
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        family]
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id, **TINY))
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(120):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, loss.item()  # it has learnt the conversation by heart
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_multi_turn_rollouts_mask_every_tool_token_and_train_on_the_template_rendering(agent_tools, tmp_path,
                                                                                        family):

    model = taught_to_call(tmp_path / family, family, tmp_path)
    raw = agent_recipe(tmp_path, model, {"environment": "agent_tools:Lockers"}, max_steps=1, top_k=1,
                       per_device_train_batch_size=4, max_tool_calling_iterations=2)
    raw["data"]["train"]["path"] = str(prompts_file(tmp_path, lockers=(7, 7)))
    run = build_run(load_recipe(raw))
    run.trainer.train()
    rollouts = list(run.trainer.recent_rollouts)
    assert len(rollouts) == 4
    # each of the 4 concurrent rollouts had an environment instance of its own (TRL pools and resets them)
    environments = run.trainer.environments
    assert len({id(e) for e in environments}) == 4 and all(e.asked == 7 and e.calls == [7] for e in environments), [run.tokenizer.decode(r["stream"][r["prompt_length"]:]) for r in rollouts]
    tokenizer = run.tokenizer
    called = 0
    for rollout in rollouts:
        stream, start, mask = rollout["stream"], rollout["prompt_length"], rollout["tool_mask"]
        completion = stream[start:]
        assert len(mask) == len(completion)
        text = tokenizer.decode(completion)
        if "</tool_call>" not in text:
            assert set(mask) == {1}
            continue
        called += 1
        # the tool's turn, read off the text: from the end of the assistant turn that called the tool to the start
        # of the next assistant turn; exactly those tokens are masked, and they hold the tool's result
        call_end = text.index("<|im_end|>", text.index("</tool_call>")) + len("<|im_end|>")
        tool_end = text.index("<|im_start|>assistant\n", call_end) + len("<|im_start|>assistant\n")
        masked = tokenizer.decode([t for t, m in zip(completion, mask) if m == 0])
        trained = [t for t, m in zip(completion, mask) if m == 1]
        assert masked == text[call_end:tool_end] and "locker 7: code K49Q" in masked
        assert tokenizer.decode(trained) == text[:call_end] + text[tool_end:]
        # the stream is the template's rendering of the final conversation (up to where generation stopped)
        rendered = tokenizer.apply_chat_template(rollout["conversation"], tools=rollout["tools"], tokenize=False,
                                                 chat_template=run.trainer.chat_template)  # None: the tokenizer's
        assert rendered.startswith(tokenizer.decode(stream)), (rendered, tokenizer.decode(stream))
    assert called == 4  # the taught model called the tool in every rollout
    history = run.trainer.state.log_history
    assert [h["tools/stream_drift"] for h in history if "tools/stream_drift" in h] == [0.0]
    assert [h["tools/call_frequency"] for h in history if "tools/call_frequency" in h] == [1.0]
    assert [h["tools/turns_mean"] for h in history if "tools/turns_mean" in h] == [2.0]
    assert [h["rewards/Lockers/mean"] for h in history if "rewards/Lockers/mean" in h] == [1.0]
