"""The recipe's ``agent`` section (ours; method grpo): the tools a rollout may call and the environment whose methods
are its tools, as late-bound ``module:function`` / ``module:Class`` strings (``hf_tune.catalog.agents`` resolves and
checks them), and how long one tool call may run."""

from __future__ import annotations

from pydantic import Field, PositiveFloat

from hf_tune.recipe.section import Section as _Section


class AgentSection(_Section):
    """Tools and an environment for GRPO's multi-turn rollouts (TRL's ``tools`` and ``environment_factory``): each
    tool a function with type hints and a docstring; an environment a class with ``reset`` whose public methods are
    the tools (and whose optional ``get_reward`` is one more reward source), one instance per concurrent rollout; a
    mapping of names to classes picks one per example by the data's ``environment`` column."""

    tools: list[str] = Field(default_factory=list, description="'module:function' per tool")
    environment: str | dict[str, str] | None = Field(
        default=None, description="'module:Class', or {name: 'module:Class'} chosen by the data's environment column")
    tool_timeout: PositiveFloat = Field(
        default=30.0, description="seconds one tool call may run; past it the call is a tool error in the conversation")
