"""The recipe's lm-eval tasks as names, read without lm-eval (pure): a task name, or the ``task:`` of a task YAML;
the metric names they give (``eval_<task>_<metric>``); hf_tune's shipped tasks."""

from __future__ import annotations

from pathlib import Path

import yaml

from hf_tune.errors import RecipeError

SHIPPED_TASKS_DIR = Path(__file__).resolve().parents[1] / "evaluation" / "tasks"


def shipped_tasks() -> dict[str, Path]:
    """hf_tune's own lm-eval tasks (offline: their examples ship with the package), by task name."""
    return {read_task_yaml(path).get("task", path.stem): path for path in sorted(SHIPPED_TASKS_DIR.glob("*.yaml"))}


def task_label(task: str) -> str:
    """The lm-eval name of a recipe entry: the entry itself, or the ``task:`` of a task YAML."""
    if not task.endswith((".yaml", ".yml")):
        return task
    path = Path(task)
    if not path.is_file():
        raise RecipeError("evaluation.tasks", f"task file {task!r} does not exist",
                          fix="give an lm-eval task name or the path of an lm-eval task YAML")
    name = read_task_yaml(path).get("task")
    if not isinstance(name, str):
        raise RecipeError("evaluation.tasks", f"{task!r} has no 'task:' name", fix="add `task: <name>` to the YAML")
    return name


def is_task_metric(metric: str, tasks: list[str]) -> bool:
    """``metric`` (with or without the ``eval_`` prefix) is one of the tasks' scores: ``eval_<task>_<metric>``."""
    name = metric if metric.startswith("eval_") else f"eval_{metric}"
    return any(name.startswith(f"eval_{task_label(task)}_") for task in tasks)


def mistyped_task(metric: str, tasks: list[str]) -> tuple[str, str] | None:
    """(a recipe task, the task the metric names) where ``metric`` (``eval_<task>_<metric>``) is no task's score but
    names one close to a recipe task: one of the two is mistyped."""
    import difflib

    parts = metric.removeprefix("eval_").split("_")
    for task in tasks:
        label = task_label(task)
        for end in range(1, len(parts)):
            named = "_".join(parts[:end])
            if named != label and difflib.SequenceMatcher(None, named, label).ratio() >= 0.85:
                return label, named
    return None


def read_task_yaml(path: Path) -> dict:
    """A task YAML's mapping; lm-eval's tags (``!function``) read as None."""
    loader = type("TaskYamlLoader", (yaml.SafeLoader,), {})
    loader.add_multi_constructor("!", lambda _loader, _suffix, _node: None)
    try:
        data = yaml.load(path.read_text(), Loader=loader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.YAMLError as err:
        raise RecipeError("evaluation.tasks", f"{path} is not valid YAML: {err}", fix="fix the task file") from err
    return data if isinstance(data, dict) else {}


def check_evaluation_tasks(recipe, causal: bool) -> None:
    """lm-eval tasks and samples score a causal LM held whole by the main process; every task YAML exists and is
    named; lm-eval is installed."""
    import importlib.util

    evaluation, training = recipe.evaluation, recipe.training
    if not (evaluation.tasks or evaluation.samples):
        return
    key = "evaluation.tasks" if evaluation.tasks else "evaluation.samples"
    if not causal:
        raise RecipeError(key, f"scores a causal LM, and model.task is {recipe.model.task!r}",
                          fix=f"remove {key} (use evaluation.metrics for a classifier)")
    if training.get("fsdp") or training.get("deepspeed"):
        raise RecipeError(key, "runs on the main process's whole model, and FSDP / DeepSpeed shard it across ranks",
                          fix=f"remove {key} and score the checkpoints beside the run: hf-tune eval RUN_DIR --watch")
    for task in evaluation.tasks:
        task_label(task)
    if evaluation.tasks and importlib.util.find_spec("lm_eval") is None:
        raise RecipeError("evaluation.tasks", "needs lm-evaluation-harness, which is not installed",
                          fix="pip install 'hf_tune[eval]'")
