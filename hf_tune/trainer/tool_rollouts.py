"""GRPO's multi-turn rollouts, checked and counted as TRL makes them (method grpo with the recipe's ``agent``).

TRL builds a rollout's tokens by concatenation: the prompt's, each generated turn's, and each tool result's rendered
suffix; the model then trains on that stream with the tool results masked out (``tool_mask``). What it trains on is
what the model reads at inference only where the stream equals the chat template's rendering of the final
conversation. ``ToolRollouts`` compares the two for every rollout that ended (a clipped one has no final turn to
render) and logs the share that differs as ``tools/stream_drift``, with a warning that shows the first difference
once; it logs ``tools/turns_mean`` (assistant turns per rollout) beside TRL's ``tools/call_frequency`` and
``tools/failure_frequency``, and keeps the last rollouts (``recent_rollouts``) for a caller to inspect.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

logger = logging.getLogger("hf_tune")

KEPT_ROLLOUTS = 64


class ToolRollouts:
    """A mixin over TRL's ``GRPOTrainer`` (before it in the bases): its ``_generate`` (private: the one place a
    batch's rollouts, their token streams and masks are together) is followed by the checks above."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recent_rollouts: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEPT_ROLLOUTS)
        self._drift_shown = False

    def _generate(self, prompts: list):
        result = super()._generate(prompts)
        if getattr(self, "tools", None):
            prompt_ids, completion_ids, tool_mask, completions = result[:4]
            self._check_rollouts(prompts, prompt_ids, completion_ids, tool_mask, completions)
        return result

    def _rollout_tools(self, index: int) -> list | None:
        if getattr(self, "environment_factories", None) is not None:
            return self._env_tools[self._batch_environments[index]] or None
        return self.tools or None

    def rendered(self, conversation: list[dict], tools: list | None) -> list[int]:
        """The chat template's tokens of a whole conversation, as TRL renders its prompts (its template, tools and
        keyword arguments)."""
        tokens = self.processing_class.apply_chat_template(
            conversation=conversation, tools=tools, chat_template=self.chat_template, tokenize=True,
            return_dict=True, **self.chat_template_kwargs)["input_ids"]
        return list(tokens[0] if tokens and isinstance(tokens[0], list) else tokens)

    def _check_rollouts(self, prompts, prompt_ids, completion_ids, tool_mask, completions) -> None:
        mode = "train" if self.model.training else "eval"
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        checked = drifted = 0
        turns = []
        for index, (prompt, completion) in enumerate(zip(prompts, completions)):
            conversation = list(prompt) + list(completion) if isinstance(prompt, list) else None
            stream = list(prompt_ids[index]) + list(completion_ids[index])
            tools = self._rollout_tools(index)
            turns.append(sum(message.get("role") == "assistant" for message in completion)
                         if isinstance(completion, list) else 1)
            self.recent_rollouts.append({"conversation": conversation, "stream": stream, "prompt_length":
                                         len(prompt_ids[index]), "tool_mask": list(tool_mask[index]),
                                         "tools": tools})
            if conversation is None or not completion_ids[index] or completion_ids[index][-1] not in ends:
                continue  # a clipped rollout has no final turn the template could render
            checked += 1
            rendered = self.rendered(conversation, tools)
            if rendered[:len(stream)] != stream:
                drifted += 1
                self._show_drift(stream, rendered)
        self._metrics[mode]["tools/turns_mean"].append(sum(turns) / max(len(turns), 1))
        self._metrics[mode]["tools/stream_drift"].append(drifted / checked if checked else 0.0)

    def _show_drift(self, stream: list[int], rendered: list[int]) -> None:
        if self._drift_shown:
            return
        self._drift_shown = True
        at = next((i for i, (a, b) in enumerate(zip(stream, rendered)) if a != b), min(len(stream), len(rendered)))
        decode = self.processing_class.decode
        trained, template = decode(stream[at:]), decode(rendered[at:])
        how = ("the same text in other tokens: the model spelled it in a tokenization the template does not use"
               if template.startswith(trained) else "other text: a turn the template renders differently (a tool "
               "call's JSON re-spelled, a tool result re-rendered)")
        logger.warning("a rollout's tokens differ from the chat template's rendering of its conversation from token "
                       "%d (trained %s, the template renders %s): %s; tools/stream_drift counts such rollouts", at,
                       stream[at:at + 6], rendered[at:at + 6], how)
