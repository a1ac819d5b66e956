"""Where each of the recipe's lm-eval tasks reads its examples, checked before any model loads: offline (or with the
Hub unreachable), a task over a Hub dataset that is not in the datasets cache is refused, naming the task and the
fix. hf_tune's shipped tasks and tasks with a ``custom_dataset`` read local files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hf_tune.catalog.sources import is_hub_dataset_id
from hf_tune.errors import RecipeError
from hf_tune.recipe.evaluation_tasks import read_task_yaml, shipped_tasks
from hf_tune.recipe.upstream import did_you_mean
from hf_tune.runtime.hub_access import dataset_is_cached

OFFLINE_TASK_FIX = ("go online once so the datasets cache holds it, unset HF_HUB_OFFLINE, or use a task over local "
                    "files: hf_tune's shipped hf_tune_arithmetic, or an lm-eval task YAML with dataset_path: json and "
                    "dataset_kwargs.data_files")


def task_configs(tasks: list[str]) -> dict[str, dict]:
    """Each recipe entry's lm-eval config (its YAML mapping; for a registered name, lm-eval's index entry). An
    unknown name is refused with lm-eval's closest names."""
    configs, names = {}, []
    shipped = shipped_tasks()
    for task in tasks:
        if task.endswith((".yaml", ".yml")):
            config = read_task_yaml(Path(task))
            configs[f"{config.get('task')} ({task})"] = config
        elif task in shipped:
            configs[task] = read_task_yaml(shipped[task])
        else:
            names.append(task)
    if names:
        from lm_eval.tasks import TaskManager

        index = TaskManager().task_index
        for name in names:
            if name not in index:
                hint = did_you_mean(name, [*shipped, *index])
                raise RecipeError("evaluation.tasks",
                                  f"{name!r} is not an lm-eval task" + (f"; {hint}" if hint else ""),
                                  fix="`lm-eval ls tasks` lists them; or give the path of a task YAML")
            configs[name] = dict(index[name].cfg or {})
    return configs


def check_task_sources(tasks: list[str], offline_reason: Callable[[], str | None]) -> None:
    """Every task is known and its local data files exist; offline (``offline_reason()`` says why, None when
    online), every task's examples are local or in the datasets cache."""
    configs = task_configs(tasks)
    for task, config in configs.items():
        _check_data_files(task, config)
    for task, config in configs.items():
        if "custom_dataset" in config:
            continue
        path = config.get("dataset_path")
        if path is not None and not is_hub_dataset_id(str(path)):
            continue
        reason = offline_reason()
        if reason is None:
            return
        if path is None:
            raise RecipeError("evaluation.tasks", f"{reason}, and the lm-eval task (or group) {task!r} names no "
                              "dataset_path hf_tune can check offline", fix="name its tasks one by one; "
                              + OFFLINE_TASK_FIX)
        if not dataset_is_cached(str(path)):
            raise RecipeError("evaluation.tasks", f"{reason}, and the lm-eval task {task!r} reads the Hub dataset "
                              f"{path!r}, which is not in the datasets cache", fix=OFFLINE_TASK_FIX)


def _check_data_files(task: str, config: dict) -> None:
    """A task's local ``dataset_kwargs.data_files`` exist (lm-eval reads them only when the task is first scored, after
    training began)."""
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    named = files.values() if isinstance(files, dict) else [files]
    for entry in named:
        for file in [entry] if isinstance(entry, str) else list(entry or []):
            if isinstance(file, str) and "://" not in file and not any(c in file for c in "*?[") \
                    and not Path(file).expanduser().exists():
                raise RecipeError("evaluation.tasks", f"the lm-eval task {task!r} reads {file!r}, which does not "
                                  "exist", fix="fix dataset_kwargs.data_files in the task YAML (a path relative to "
                                  "the folder the run starts in, or an absolute one)")
