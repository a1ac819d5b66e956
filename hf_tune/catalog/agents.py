"""The recipe's ``agent`` section resolved: the tools (``module:function``) and environments (``module:Class``) of
GRPO's multi-turn rollouts, checked when the recipe loads as TRL will use them, and handed to TRL guarded.

TRL's ``GRPOTrainer`` renders each tool's JSON schema from its type hints and docstring, calls an environment's
public methods as tools (``reset`` before each rollout, ``get_reward`` after it), and turns a tool that raises into
``{"error": ...}`` in the conversation. hf_tune checks all of that before any model loads, and guards each call: a
tool that runs past ``agent.tool_timeout`` or returns something other than a string raises in the call, so TRL
records a tool failure and the rollout goes on (``tools/failure_frequency``); the run never crashes on a tool.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from hf_tune.catalog.late_bound import resolve
from hf_tune.catalog.methods import METHODS, method_of
from hf_tune.errors import RecipeError

ENVIRONMENT_COLUMN = "environment"  # the data column that picks an environment by name (TRL's)
_NOT_TOOLS = ("reset", "get_reward")


def _resolved(path: Any, key: str, kind: str) -> Any:
    if not isinstance(path, str) or ":" not in path:
        raise RecipeError(key, f"expected 'module:{kind}', got {path!r}", fix=f"e.g. my_tools:{kind.lower()}")
    try:
        return resolve(path)
    except (ImportError, AttributeError) as err:
        raise RecipeError(key, f"{path!r} cannot be imported ({err})",
                          fix="check the module is on PYTHONPATH (the recipe's folder is not added) and the name is "
                          "defined in it") from None


def check_tool(function: Callable, key: str) -> None:
    """``function`` renders as a tool the way TRL renders it (transformers' ``get_json_schema``: a docstring, a type
    hint and an ``Args:`` line for every parameter), else a RecipeError naming ``key``."""
    from transformers.utils import get_json_schema  # loads transformers: only for a recipe with tools

    if not callable(function):
        raise RecipeError(key, f"{function!r} is not callable", fix="name a function")
    try:
        get_json_schema(function)
    except Exception as err:  # transformers' parsing exceptions, and anything a strange callable raises
        raise RecipeError(key, f"{getattr(function, '__qualname__', function)} cannot be described to the model: "
                          f"{err}", fix="give every parameter a type hint, and the function a docstring with a "
                          "summary line and an Args: section naming each parameter") from None


def tool_methods(environment: type) -> list[str]:
    """The names of an environment class's tools: its public functions other than ``reset`` and ``get_reward``."""
    return [name for name, _ in inspect.getmembers(environment, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in _NOT_TOOLS]


def check_environment(environment: Any, key: str) -> None:
    """An environment TRL can run: a class with ``reset`` and at least one tool method, each a tool as
    ``check_tool`` checks it."""
    if not inspect.isclass(environment):
        raise RecipeError(key, f"{environment!r} is not a class", fix="name a class whose methods are the tools")
    if not callable(getattr(environment, "reset", None)):
        raise RecipeError(key, f"{environment.__qualname__} has no reset method, which TRL calls before each rollout",
                          fix="add def reset(self, **kwargs) -> str | None (it may return text appended to the prompt)")
    names = tool_methods(environment)
    if not names:
        raise RecipeError(key, f"{environment.__qualname__} has no public method to offer as a tool",
                          fix="add a method with type hints and a docstring (an Args: line per parameter)")
    for name in names:
        check_tool(getattr(environment, name), f"{key} ({name})")


def environments(agent) -> dict[str | None, str]:
    """The environment paths by name (``None``: the one environment of every example)."""
    if agent.environment is None:
        return {}
    return dict(agent.environment) if isinstance(agent.environment, dict) else {None: agent.environment}


def check_agent(recipe) -> None:
    """The ``agent`` section against the method and TRL's contract: each tool and environment importable and
    describable, and the turn bound positive. Imports the user's modules (as the rewards' check does)."""
    agent = recipe.agent
    turns = recipe.training.get("max_tool_calling_iterations")
    if turns is not None and (not isinstance(turns, int) or turns < 1):
        raise RecipeError("training.max_tool_calling_iterations", f"is {turns!r}; it bounds the tool-calling turns "
                          "of one rollout", fix="use a whole number of 1 or more, or remove it (no bound)")
    if agent is None:
        return
    if not method_of(recipe.method).tools:
        runs = [name for name, method in METHODS.items() if method.tools]
        raise RecipeError("agent", f"method {recipe.method!r} runs no tools: TRL {version('trl')}'s multi-turn "
                          f"rollouts (tools, environment_factory) are {' and '.join(runs)}'s",
                          fix=f"set method: {runs[0]}, or remove agent")
    if not agent.tools and agent.environment is None:
        raise RecipeError("agent", "names no tool and no environment", fix="add agent.tools: ['module:function'] "
                          "or agent.environment: 'module:Class', or remove agent")
    for index, path in enumerate(agent.tools):
        check_tool(_resolved(path, f"agent.tools[{index}]", "function"), f"agent.tools[{index}]")
    rewarding = []
    for name, path in environments(agent).items():
        key = "agent.environment" if name is None else f"agent.environment.{name}"
        environment = _resolved(path, key, "Class")
        check_environment(environment, key)
        rewarding += [key] if callable(getattr(environment, "get_reward", None)) else []
    if not recipe.rewards and not rewarding:
        raise RecipeError("rewards", "GRPO needs a reward: the recipe has no rewards, and no environment defines "
                          "get_reward", fix="add rewards: [...], or a get_reward(self) -> float method to the "
                          "environment")


def check_environment_column(agent, column_names: list[str], values: Callable[[], list], where: str) -> None:
    """With named environments, the data picks one per example by its ``environment`` column: the column must be
    there and name only known environments (``values`` reads it)."""
    if agent is None or not isinstance(agent.environment, dict):
        return
    known = sorted(agent.environment)
    if ENVIRONMENT_COLUMN not in column_names:
        raise RecipeError("agent.environment", f"names environments {known}, and {where} has no "
                          f"{ENVIRONMENT_COLUMN!r} column to pick one per example",
                          fix=f"add an {ENVIRONMENT_COLUMN!r} column, or give agent.environment one 'module:Class'")
    unknown = sorted({str(value) for value in values()} - set(known))
    if unknown:
        raise RecipeError("agent.environment", f"{where}'s {ENVIRONMENT_COLUMN!r} column names {unknown}, which "
                          f"agent.environment does not define (it has {known})",
                          fix="add them to agent.environment, or correct the column")


class ToolTimeout(TimeoutError):
    pass


def guarded(function: Callable, timeout: float, name: str | None = None) -> Callable:
    """``function`` as TRL will call it, with its signature and docstring (its schema is unchanged), but run in a
    daemon thread for at most ``timeout`` seconds, and refusing a result that is not a string: both raise, which
    TRL turns into a tool error in the conversation and a counted failure. A call past its time is abandoned (a
    thread cannot be stopped), and its late result is dropped."""
    label = name or function.__name__

    @functools.wraps(function)
    def call(*args, **kwargs):
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = function(*args, **kwargs)
            except BaseException as err:  # handed to the caller's thread as the tool's failure
                outcome["error"] = err

        worker = threading.Thread(target=run, name=f"tool {label}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise ToolTimeout(f"tool {label} ran past {timeout:g} s (agent.tool_timeout)")
        if "error" in outcome:
            raise outcome["error"]
        result = outcome["result"]
        if not isinstance(result, str):
            raise TypeError(f"tool {label} returned {type(result).__name__}, not a string")
        return result

    return call


def guarded_environment(environment: type, timeout: float) -> type:
    """A subclass of ``environment`` whose tool methods are ``guarded`` (TRL reads the tools from the instance's
    class, so the guard must be on the class)."""
    methods = {name: guarded(getattr(environment, name), timeout, f"{environment.__name__}.{name}")
               for name in tool_methods(environment)}
    return type(environment.__name__, (environment,), {**methods, "__module__": environment.__module__,
                                                       "__qualname__": environment.__qualname__})


def trainer_agent_kwargs(agent) -> dict[str, Any]:
    """GRPOTrainer's ``tools`` and ``environment_factory`` from the section: every tool guarded; each environment
    class (a factory TRL calls once per concurrent rollout) guarded."""
    if agent is None:
        return {}
    kwargs: dict[str, Any] = {}
    if agent.tools:
        kwargs["tools"] = [guarded(resolve(path), agent.tool_timeout) for path in agent.tools]
    factories = {name: guarded_environment(resolve(path), agent.tool_timeout)
                 for name, path in environments(agent).items()}
    if factories:
        kwargs["environment_factory"] = factories if isinstance(agent.environment, dict) else factories[None]
    return kwargs


def check_tool_template(tokenizer, recipe) -> None:
    """The chat template can render a tool call and its result, and TRL can parse the model's tool calls back out of
    it (``add_response_schema`` knows the template), else a RecipeError naming ``data.chat_template`` and the named
    templates that would do. A template that is not prefix-preserving is replaced by TRL's training variant for the
    rollouts; hf_tune says so in the log."""
    from trl.chat_template_utils import add_response_schema, is_chat_template_prefix_preserving, supports_tool_calling

    where = f"the chat template of {recipe.model.pretrained_model_name_or_path}"
    if recipe.data.chat_template:
        where = f"data.chat_template {recipe.data.chat_template!r}" if len(recipe.data.chat_template) < 60 \
            else "data.chat_template"
    fix = ("set data.chat_template to a named template TRL parses tool calls of and that is prefix-preserving: "
           "qwen2_5 (ChatML markers, <tool_call> JSON) fits ChatML models such as SmolLM2; qwen3_8, gemma4, lfm2_v2 "
           "their families")
    if not supports_tool_calling(tokenizer):
        raise RecipeError("data.chat_template", f"{where} cannot render an assistant's tool call and the tool's "
                          "result, which a multi-turn rollout needs", fix=fix)
    try:
        add_response_schema(copy.copy(tokenizer))  # on a copy: TRL sets the parser itself as it builds the trainer
    except ValueError as err:
        raise RecipeError("data.chat_template", f"TRL cannot parse the tool calls a model writes in {where} ({err})",
                          fix=fix) from None
    if not is_chat_template_prefix_preserving(tokenizer):
        logging.getLogger("hf_tune").warning(
            "%s is not prefix-preserving (an earlier turn renders differently once a later one follows): TRL renders "
            "the rollouts with its training variant of it, and the trained tokens may differ from what this template "
            "renders at inference", where)


def offered_tool_names(agent) -> list[str]:
    """The names of the tools a rollout is offered: the section's functions, then each environment's methods."""
    if agent is None:
        return []
    names = [path.rpartition(":")[2] for path in agent.tools]
    for path in environments(agent).values():
        names += [name for name in tool_methods(resolve(path)) if name not in names]
    return names


def rollout_prompt(agent, row: dict) -> tuple[list[dict], list[Callable]]:
    """An example's prompt and tools as a rollout starts, the way TRL prepares them: the section's functions and the
    methods of a fresh instance of the example's environment, whose ``reset(**row)`` has run (a string it returns is
    appended to the last message)."""
    prompt = list(row["prompt"])
    tools = [resolve(path) for path in agent.tools]
    several = isinstance(agent.environment, dict)
    path = environments(agent).get(row.get(ENVIRONMENT_COLUMN) if several else None)
    if path is not None:
        instance = resolve(path)()
        observation = instance.reset(**{k: v for k, v in row.items() if not (several and k == ENVIRONMENT_COLUMN)})
        if isinstance(observation, str) and prompt and isinstance(prompt[-1].get("content"), str):
            prompt[-1] = {**prompt[-1], "content": prompt[-1]["content"] + observation}
        tools += [getattr(instance, name) for name in tool_methods(type(instance))]
    return prompt, tools
