"""A conversation rendered by its chat template, and the character spans of the assistant turns to train.

Three ways to locate the spans, tried in this order (docs/data.md, "Which tokens train"):

1. ``{% generation %}`` markers: a template that marks assistant output (TRL's ``*_training.jinja`` templates do) is
   rendered once and its marked spans are the trained ones, as ``return_assistant_tokens_mask`` reads them.
2. The prefix rule: a turn runs from the end of the conversation before it rendered with the generation prompt to
   the end of the conversation through it, when both are prefixes of the whole rendering. Exact for templates that
   render each turn independently (ChatML, Llama-3, Mistral, Gemma, Qwen2.5, with or without tools).
3. Render once, locate by markers: templates that rewrite earlier turns (Qwen3 strips the reasoning of every turn
   before the last question, and gives the last turn an empty think block) break the prefix rule. The whole
   conversation is then rendered once, as it is at inference, and each assistant turn starts where the conversation
   before it, rendered with the generation prompt, ends (still a prefix), or, where that history is rewritten too
   (the reasoning of a turn before a later question), after the next assistant header (what the generation prompt
   adds) of the full rendering; it ends with the template's end-of-turn marker (found by rendering a probe
   exchange). Each turn is trained as it appears in the full rendering: reasoning a template drops is not trained.

A conversation none of these can locate is refused, naming ``data.chat_template`` and the fix.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from hf_tune.data.messages import called_names, tool_names
from hf_tune.errors import RecipeError

logger = logging.getLogger(__name__)
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TEMPLATE_FIX = ("set data.chat_template to a template that renders each turn on its own, or one that marks assistant "
                 "output with {% generation %} ... {% endgeneration %} (as TRL's *_training.jinja templates do)")
_TOOLS_FIX = ("set data.chat_template to the model family's tool-use template (one that renders `tools` and each "
              "message's `tool_calls`, e.g. Qwen2.5's or Llama-3.1's)")
_PROBE_TOOL = {"type": "function", "function": {
    "name": "hf_tune_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
_PROBE_CONVERSATION = [
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "a1b2c3d4e", "function": {"name": "hf_tune_probe_call", "arguments": {"x": 1}}}]},
    {"role": "tool", "content": "hf_tune_probe_result", "tool_call_id": "a1b2c3d4e", "name": "hf_tune_probe_call"},
    {"role": "assistant", "content": "probe answer"},
]
_reported: set[str] = set()
_end_of_turn_cache: dict[tuple[str, str], str] = {}
_header_cache: dict[tuple[str, str], str] = {}


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
           generation_prompt: bool = False) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateError as err:  # the template's own raise_exception: roles it does not take, order it wants
        roles = "/".join(m["role"] for m in messages)
        raise RecipeError("data.chat_template", f"the chat template refused a conversation ({roles}): {err}",
                          fix="make the conversations fit the template (Mistral's and Gemma's have no system role: "
                              "put its text in the first user turn), or set data.chat_template to one that takes "
                              "them") from err


def assistant_char_spans(tokenizer, messages: list[dict[str, Any]], prompt_turns: int = 0,
                         tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return its text and the character spans of each assistant turn after the first
    ``prompt_turns`` messages (a prompt's own assistant turns are context, not trained). A span starts where the
    assistant's output starts and ends on its end-of-turn token (trailing whitespace not included)."""
    if GENERATION_MARKER.search(tokenizer.chat_template or ""):
        return _marked_spans(tokenizer, messages, prompt_turns, tools)
    text = render(tokenizer, messages, tools)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= prompt_turns]
    spans = []
    for i in turns:
        before = render(tokenizer, messages[:i], tools, generation_prompt=True)
        through = render(tokenizer, messages[: i + 1], tools)
        if not (text.startswith(before) and text.startswith(through) and len(through.rstrip()) > len(before)):
            return text, _spans_in_one_rendering(tokenizer, messages, turns, tools, text)
        spans.append((len(before), len(through.rstrip())))
    return text, spans


def _marked_spans(tokenizer, messages, prompt_turns, tools) -> tuple[str, list[tuple[int, int]]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(
        conversations=[messages], tools=tools, chat_template=tokenizer.get_chat_template(None, tools),
        return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    text, spans = rendered[0], [(start, end) for start, end in indices[0]]
    if prompt_turns:
        prompt_end = len(render(tokenizer, messages[:prompt_turns], tools, generation_prompt=True))
        spans = [(start, end) for start, end in spans if start >= prompt_end]
    return text, [(start, start + len(text[start:end].rstrip())) for start, end in spans]


def _spans_in_one_rendering(tokenizer, messages, turns, tools, text) -> list[tuple[int, int]]:
    template = tokenizer.chat_template or ""
    if template not in _reported:
        _reported.add(template)
        logger.info("the chat template rewrites earlier turns (it strips reasoning or re-renders history): assistant "
                    "turns are located in the whole conversation rendered once, by the generation prompt and the "
                    "end-of-turn marker %r", end_of_turn(tokenizer))
    marker, header, spans = end_of_turn(tokenizer), generation_header(tokenizer), []
    for i in turns:
        before = render(tokenizer, messages[:i], tools, generation_prompt=True)
        start = len(before) if text.startswith(before) else -1
        if start < 0 and header:  # the history before this turn is rewritten too (Qwen3 strips its reasoning once a
            # later question follows): the turn starts after the next assistant header of the full rendering
            at = text.find(header, spans[-1][1] if spans else 0)
            start = at + len(header) if at >= 0 else -1
        end = text.find(marker, start) if marker and start >= 0 else -1
        if end < 0 or (spans and start < spans[-1][1]):
            raise RecipeError("data.chat_template", f"the chat template renders turn {i + 1} differently once later "
                              "turns follow, and its start or end-of-turn marker cannot be found in the whole "
                              "conversation, so the assistant tokens cannot be located", fix=_TEMPLATE_FIX)
        spans.append((start, end + len(marker)))
    return spans


def generation_header(tokenizer) -> str:
    """What the generation prompt adds to open an assistant turn (``<|im_start|>assistant\n``...), found by rendering
    a probe question with and without it; empty when the template's prompt is not an addition at the end."""
    key = (tokenizer.chat_template or "", str(tokenizer.special_tokens_map))
    if key not in _header_cache:
        probe = [{"role": "user", "content": "probe question"}]
        plain, prompted = render(tokenizer, probe), render(tokenizer, probe, generation_prompt=True)
        _header_cache[key] = prompted[len(plain):] if prompted.startswith(plain) else ""
    return _header_cache[key]


def end_of_turn(tokenizer) -> str:
    """What the template writes after an assistant's content to close the turn (``<|im_end|>``, ``<|eot_id|>``...)."""
    key = (tokenizer.chat_template or "", str(tokenizer.special_tokens_map))
    if key not in _end_of_turn_cache:
        probe = [{"role": "user", "content": "probe question"}, {"role": "assistant", "content": "PROBE-ANSWER"}]
        through = render(tokenizer, probe)
        at = through.rfind("PROBE-ANSWER")
        _end_of_turn_cache[key] = through[at + len("PROBE-ANSWER"):].rstrip() if at >= 0 else ""
    return _end_of_turn_cache[key]


def check_template_renders_tools(tokenizer) -> None:
    """Refuse a chat template that drops tool schemas, assistant tool calls or tool results (SmolLM2's ChatML renders
    only ``content``): the model would never see the tools it is trained to call."""
    try:
        text = render(tokenizer, _PROBE_CONVERSATION, [_PROBE_TOOL])
    except Exception as err:  # a template that raises on tools (Gemma refuses any role but user/assistant)
        raise RecipeError("data.chat_template", f"the chat template cannot render tool calls: {err}",
                          fix=_TOOLS_FIX) from err
    missing = [what for what, name in (("the tool schemas (`tools`)", "hf_tune_probe_tool"),
                                       ("assistant `tool_calls`", "hf_tune_probe_call"),
                                       ("tool results (role `tool`)", "hf_tune_probe_result")) if name not in text]
    if missing:
        raise RecipeError("data.chat_template", f"the data has tool calls but the chat template drops "
                          f"{', '.join(missing)}", fix=_TOOLS_FIX)


def check_tools_rendered(text: str, messages: list[dict[str, Any]], tools: list[dict] | None) -> None:
    """Every offered tool and every called function of this conversation appears in its rendering."""
    lost = [name for name in tool_names(tools) + called_names(messages) if name and name not in text]
    if lost:
        raise RecipeError("data.chat_template", f"the chat template dropped tools or tool calls {lost[:3]} of a "
                          "conversation", fix=_TOOLS_FIX)
