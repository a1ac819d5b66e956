"""Tool calling: tools reach the chat template, messages keep their tool calls, LLaMA-Factory's function_call /
observation turns become tool calls and tool results; the assistant's calls are trained, tool results are not.
Masks are compared with references written turn by turn from the Qwen2.5 and Llama-3.1 formats, without Jinja."""

from __future__ import annotations

import json

import pytest
from chat_templates import QWEN_SYSTEM, family_tokenizer, reference
from conftest import DATA, chat_recipe

from hf_tune.data.loading import load_source
from hf_tune.data.messages import sharegpt_messages
from hf_tune.data.tokenization import IGNORE_INDEX, tokenize_dataset
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import DataSection, DatasetSource

GLAIVE = DATA / "glaive_toolcall_demo.json"
MESSAGES = DATA / "tool_messages_demo.jsonl"


def glaive_rows():
    """The LLaMA-Factory file as (messages, tools) in OpenAI's shape, converted here by hand."""
    rows = []
    for row in json.loads(GLAIVE.read_text()):
        messages = []
        for turn in row["conversations"]:
            if turn["from"] == "function_call":
                call = json.loads(turn["value"])
                messages.append({"role": "assistant", "calls": [(call["name"], call["arguments"])]})
            elif turn["from"] == "observation":
                messages.append({"role": "tool", "content": turn["value"]})
            else:
                messages.append({"role": {"human": "user", "gpt": "assistant"}[turn["from"]], "content": turn["value"]})
        rows.append((messages, [{"type": "function", "function": t} for t in json.loads(row["tools"])]))
    return rows


def message_rows():
    rows = []
    for line in MESSAGES.read_text().splitlines():
        row = json.loads(line)
        messages = []
        for m in row["messages"]:
            if m.get("tool_calls"):
                calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
                messages.append({"role": "assistant", "calls": calls})
            else:
                messages.append({"role": m["role"], "content": m["content"]})
        rows.append((messages, row["tools"]))
    return rows


def qwen25_segments(messages, tools):
    system = messages[0]["content"] if messages[0]["role"] == "system" else QWEN_SYSTEM
    segments = [("<|im_start|>system\n" + system + "\n\n# Tools\n\nYou may call one or more functions to assist with "
                 "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
                 "<tools>" + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>\n\nFor "
                 "each function call, return a json object with function name and arguments within "
                 "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                 "<args-json-object>}\n</tool_call><|im_end|>\n", False)]
    for i, m in enumerate(messages):
        if m["role"] == "system" and i == 0:
            continue
        if m["role"] == "tool":
            first = messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            segments.append((("<|im_start|>user" if first else "") + "\n<tool_response>\n" + m["content"]
                             + "\n</tool_response>" + ("<|im_end|>\n" if last else ""), False))
        elif "calls" in m:
            calls = "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}'
                              "\n</tool_call>" for name, args in m["calls"])
            segments += [("<|im_start|>assistant\n", False), (calls + "<|im_end|>", True), ("\n", False)]
        else:
            segments += [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>", m["role"] == "assistant"),
                         ("\n", False)]
    return segments


def llama31_segments(messages, tools):
    system = ""
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    segments = [("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting "
                 "Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" + system + "<|eot_id|>", False),
                ("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a "
                 "JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond "
                 'in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do '
                 "not use variables.\n\n" + "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools)
                 + messages[0]["content"].strip() + "<|eot_id|>", False)]
    for m in messages[1:]:
        if m["role"] == "tool":
            segments.append(("<|start_header_id|>ipython<|end_header_id|>\n\n" + json.dumps(m["content"], ensure_ascii=False)
                             + "<|eot_id|>", False))
            continue
        segments.append((f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n", False))
        if "calls" in m:
            (name, args), = m["calls"]
            segments.append((f'{{"name": "{name}", "parameters": {json.dumps(args, ensure_ascii=False)}}}<|eot_id|>',
                             True))
        else:
            segments.append((m["content"].strip() + "<|eot_id|>", m["role"] == "assistant"))
    return segments


SEGMENTS = {"QWEN2_5": qwen25_segments, "LLAMA3_1": llama31_segments}
SETS = {"glaive": (GLAIVE, glaive_rows), "messages": (MESSAGES, message_rows)}
TRAINED_SETS = {**SETS, "reasoning": (REASONING_FILE := DATA / "reason_tool_use_demo.jsonl",
                                       lambda: REASONING_FILE.read_text().splitlines()),
                "content_parts": (PARTS_FILE := DATA / "content_parts_demo.jsonl",
                                  lambda: PARTS_FILE.read_text().splitlines())}


def test_function_call_and_observation_turns_become_tool_calls_and_tool_results():
    turns = json.loads(GLAIVE.read_text())[3]["conversations"]
    messages = sharegpt_messages(turns)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"] * 2
    first_call, second_call = messages[1]["tool_calls"][0], messages[5]["tool_calls"][0]
    assert first_call == {"type": "function", "id": "call00000",
                          "function": {"name": "calculate_area", "arguments": {"width": 3, "height": 4}}}
    assert messages[2] == {"role": "tool", "content": '{"area": 12}', "tool_call_id": "call00000",
                           "name": "calculate_area"}
    assert second_call["id"] == messages[6]["tool_call_id"] == "call00001"
    assert second_call["function"]["arguments"] == {"city": "Lima", "unit": "fahrenheit"}


@pytest.mark.parametrize("family", list(SEGMENTS))
@pytest.mark.parametrize("name", list(SETS))
def test_tool_call_masks_equal_the_turn_by_turn_reference(smol_tokenizer, family, name):
    path, rows = SETS[name]
    tokenizer = family_tokenizer(smol_tokenizer, family)
    raw = load_source(DatasetSource(path=str(path)), "data.train", "chat")
    tokenized = tokenize_dataset(raw, tokenizer, DataSection(train={"path": str(path)}, max_length=4096), "data.train")
    assert len(tokenized) == len(rows())
    for row, (messages, tools) in zip(tokenized, rows()):
        segments = SEGMENTS[family](messages, tools)
        text, ids, labels = reference(tokenizer, segments)
        assert (row["input_ids"], row["labels"]) == (ids, labels), text
        trained = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
        assert trained == "".join(s for s, train in segments if train)
        assert "<tool_response>" not in trained and "ipython" not in trained  # tool results are context


def test_data_tools_reach_the_template_for_examples_without_a_tools_column(tmp_path, smol_tokenizer):
    tokenizer = family_tokenizer(smol_tokenizer, "QWEN2_5")
    rows = [json.loads(line) for line in MESSAGES.read_text().splitlines()]
    tools = rows[0].pop("tools")
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    (tmp_path / "d.jsonl").write_text(json.dumps(rows[0]) + "\n")
    data = DataSection(train={"path": str(tmp_path / "d.jsonl")}, tools=str(tmp_path / "tools.json"), max_length=4096)
    raw = load_source(data.train, "data.train", "chat")
    row = tokenize_dataset(raw, tokenizer, data, "data.train")[0]
    messages, _ = message_rows()[0]
    assert (row["input_ids"], row["labels"]) == reference(tokenizer, qwen25_segments(messages, tools))[1:]


@pytest.mark.parametrize("name", list(SETS))
def test_a_template_that_drops_tools_is_refused_when_the_data_loads(smol_tokenizer, name):
    """SmolLM2's ChatML renders only `content`: the tools and the calls would silently vanish."""
    path, _ = SETS[name]
    raw = load_source(DatasetSource(path=str(path)), "data.train", "chat")
    with pytest.raises(HfTuneError, match=r"data.chat_template: the data has tool calls but the chat template drops "
                                          r"the tool schemas \(`tools`\), assistant `tool_calls`\n  fix: set "
                                          r"data.chat_template to the model family's tool-use template"):
        tokenize_dataset(raw, smol_tokenizer, DataSection(train={"path": str(path)}), "data.train")


def test_qwen3_trains_the_tool_call_and_the_answer_as_the_full_rendering_shows_them(smol_tokenizer):
    """Qwen3 gives the last turn an empty think block that the call turn loses once the answer follows: both are
    located in the one full rendering; the tool result between them is not trained."""
    from datasets import Dataset

    tokenizer = family_tokenizer(smol_tokenizer, "QWEN3")
    (messages, tools), = [r for r in message_rows() if len(r[0]) == 4][:1]
    row = json.loads(MESSAGES.read_text().splitlines()[0])
    tokenized = tokenize_dataset(Dataset.from_list([row]), tokenizer, DataSection(train={"path": "x"}, max_length=4096),
                                 "data.train")
    trained = tokenizer.decode([t for t in tokenized[0]["labels"] if t != IGNORE_INDEX])
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
                       "<think>\n\n</think>\n\nIt is 4 degrees and cloudy in Oslo.<|im_end|>")


@pytest.mark.parametrize("name, family", [("glaive", "LLAMA3_1"), ("messages", "QWEN2_5"),
                                          ("reasoning", "QWEN3_TRAINING"), ("content_parts", None)])
def test_tool_calling_sets_train(tmp_path, tiny_llama_dir, smol_tokenizer, name, family):
    """A real Trainer run on each set with a tool-capable template given as data.chat_template."""
    import chat_templates

    from hf_tune import load_recipe, train

    recipe = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=2)
    recipe["data"].update(train={"path": str(TRAINED_SETS[name][0])}, max_length=1024)
    if family:  # else SmolLM2's own template
        template = tmp_path / "template.jinja"
        template.write_text(getattr(chat_templates, family))
        recipe["data"]["chat_template"] = str(template)
    trainer = train(load_recipe(recipe))
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert trainer.train_dataset.num_rows == len(TRAINED_SETS[name][1]())


# --- typed content parts: LLaMA-Factory's reasoning and tool-call parts, OpenAI's text parts -----------------------

REASONING = DATA / "reason_tool_use_demo.jsonl"  # LLaMA-Factory's reason_tool_use layout, written for hf_tune
CONTENT_PARTS = DATA / "content_parts_demo.jsonl"  # OpenAI's layout: text parts, some turns plain strings


def reasoning_rows():
    """The LLaMA-Factory file read here by hand: (messages with text, reasoning and calls apart, tools)."""
    rows = []
    for line in REASONING.read_text().splitlines():
        row = json.loads(line)
        messages = []
        for m in row["messages"]:
            of = lambda kind: [p["value"] for p in m["content"] if p["type"] == kind]  # noqa: E731
            messages.append({"role": m["role"], "content": "".join(of("text")), "reasoning": "".join(of("reasoning")),
                             "calls": [json.loads(call) for call in of("tool_call")]})
        rows.append((messages, json.loads(row["tools"])))
    return rows


def qwen3_segments(messages, tools, think_before_last_question: bool):
    """Qwen3's format written out turn by turn: the tools in the system turn, each assistant turn's think block (the
    training variant renders them all; Qwen3's own only after the last question), answer and calls trained up to
    <|im_end|>; tool results inside a user turn, untrained."""
    system = messages[0]["content"] + "\n\n" if messages[0]["role"] == "system" else ""
    segments = [("<|im_start|>system\n" + system + "# Tools\n\nYou may call one or more functions to assist with the "
                 "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
                 + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + "\n</tools>\n\nFor each "
                 "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                 "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
                 "</tool_call><|im_end|>\n", False)]
    last_question = max(i for i, m in enumerate(messages) if m["role"] == "user")
    for i, m in enumerate(messages):
        if m["role"] == "system" and i == 0:
            continue
        if m["role"] == "user":
            segments.append((f"<|im_start|>user\n{m['content']}<|im_end|>\n", False))
        elif m["role"] == "tool":
            first = messages[i - 1]["role"] != "tool"
            last = i == len(messages) - 1 or messages[i + 1]["role"] != "tool"
            segments.append((("<|im_start|>user" if first else "") + "\n<tool_response>\n" + m["content"]
                             + "\n</tool_response>" + ("<|im_end|>\n" if last else ""), False))
        else:
            think = think_before_last_question or i > last_question
            answer = (f"<think>\n{m['reasoning']}\n</think>\n\n" if think else "") + m["content"]
            for n, call in enumerate(m["calls"]):
                answer += ("\n" if n or m["content"] else "") + (
                    f'<tool_call>\n{{"name": "{call["name"]}", "arguments": '
                    f'{json.dumps(call["arguments"], ensure_ascii=False)}}}\n</tool_call>')
            segments += [("<|im_start|>assistant\n", False), (answer + "<|im_end|>", True), ("\n", False)]
    return segments


@pytest.mark.parametrize("family, think_before_last_question", [("QWEN3_TRAINING", True), ("QWEN3", False)])
def test_reasoning_and_tool_call_parts_train_as_the_turn_by_turn_reference(smol_tokenizer, family,
                                                                           think_before_last_question):
    """Each assistant turn's reasoning (where the template renders it), answer and calls train, and nothing else:
    system, tools, questions and tool results are context. Qwen3's own template drops the reasoning of the turns
    before the last question, so those turns train without it, as the full rendering shows them."""
    tokenizer = family_tokenizer(smol_tokenizer, family)
    raw = load_source(DatasetSource(path=str(REASONING)), "data.train", "chat")
    tokenized = tokenize_dataset(raw, tokenizer, DataSection(train={"path": str(REASONING)}, max_length=4096),
                                 "data.train")
    assert len(tokenized) == len(reasoning_rows()) == 5
    for row, (messages, tools) in zip(tokenized, reasoning_rows()):
        segments = qwen3_segments(messages, tools, think_before_last_question)
        text, ids, labels = reference(tokenizer, segments)
        assert (row["input_ids"], row["labels"]) == (ids, labels), text
        trained = tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])
        assert "<tool_response>" not in trained and "<|im_start|>" not in trained
    dropped = tokenizer.decode([t for t in tokenized[1]["labels"] if t != IGNORE_INDEX])  # two questions
    assert ("Light rain at 9 degrees" in dropped) == think_before_last_question
    assert "Sunny and 24 degrees" in dropped  # the turn after the last question keeps its reasoning


def test_openai_text_parts_train_as_the_same_conversation_with_string_content(smol_tokenizer, tmp_path):
    """Text parts joined (no separator, as transformers' templates concatenate them) are the string content: the
    tokens and labels of the file equal those of its copy written with strings."""
    rows = [json.loads(line) for line in CONTENT_PARTS.read_text().splitlines()]
    as_strings = [{"messages": [{**m, "content": m["content"] if isinstance(m["content"], str) else
                                 "".join(p["text"] for p in m["content"])} for m in row["messages"]]} for row in rows]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(row) + "\n" for row in as_strings))
    section = DataSection(train={"path": "x"}, max_length=512)
    parts = tokenize_dataset(load_source(DatasetSource(path=str(CONTENT_PARTS)), "data.train", "chat"),
                             smol_tokenizer, section, "data.train")
    strings = tokenize_dataset(load_source(DatasetSource(path=str(plain)), "data.train", "chat"),
                               smol_tokenizer, section, "data.train")
    assert parts["input_ids"] == strings["input_ids"] and parts["labels"] == strings["labels"]
    second = smol_tokenizer.decode([t for t in parts[1]["labels"] if t != IGNORE_INDEX])
    assert "Bonjour." in second and "Only the translation" not in second


@pytest.mark.parametrize("content, role, message", [
    ([{"type": "input_audio", "input_audio": {}}], "user",
     "content part 1 has type 'input_audio', which chat does not read: expected one of 'text', 'reasoning', "
     "'tool_call'"),
    ([{"type": "text", "text": "a"}, {"type": "image"}], "user",
     "content part 2 has type 'image', which chat does not read: expected one of 'text', 'reasoning', 'tool_call' "
     "(images are read by data.format: vision_chat)"),
    ([{"type": "reasoning", "value": "hm"}], "user",
     "content part 1 is a reasoning part in a 'user' turn: only assistant turns reason or call tools"),
    ([{"type": "text", "content": "a"}], "user", "content part 1 (text) has keys ['content', 'type']: its text goes "
                                                 "in 'text' (OpenAI) or 'value' (LLaMA-Factory)"),
    (["just text"], "user", "content part 1: expected an object with a 'type', got a string"),
])
def test_a_part_chat_cannot_read_is_refused_by_name(content, role, message):
    from hf_tune.data.validation import turns_problem

    turns = [{"role": role, "content": content}, {"role": "assistant", "content": "ok"}]
    assert turns_problem(turns, ("role", "content"), "messages") == f"turn 1: {message}"


def test_tool_call_parts_with_a_template_that_drops_tools_are_refused(smol_tokenizer, tmp_path):
    """The calls of LLaMA-Factory's parts count as tool calls even without a tools column: SmolLM2's ChatML would
    drop them silently."""
    rows = [json.loads(line) for line in REASONING.read_text().splitlines()]
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    raw = load_source(DatasetSource(path=str(path)), "data.train", "chat")
    with pytest.raises(HfTuneError, match=r"data.chat_template: the data has tool calls but the chat template drops"):
        tokenize_dataset(raw, smol_tokenizer, DataSection(train={"path": str(path)}), "data.train")


def test_a_tools_json_string_keeps_its_nulls_and_a_list_column_loses_arrow_s_filler():
    from hf_tune.data.messages import example_tools

    schema = {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": None}}
    written = example_tools({"tools": json.dumps([schema])}, None)  # LLaMA-Factory's reason_tool_use layout
    assert written == [{"type": "function", "function": schema}]  # as the data says, "required": null included
    filled = {**schema, "strict": None}  # a key Arrow adds as null where another row has it
    assert example_tools({"tools": [filled]}, None)[0]["function"] == {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
