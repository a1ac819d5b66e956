"""The search backend table: each ``search.backend`` with the functions that run a study and read its trials back
(``module:function``, imported when used), its package, and what it can do, which the recipe checks, the search
section's ``Literal`` and ``hf-tune compare`` read. A new backend is one entry here plus its own module."""

from __future__ import annotations

import dataclasses
from typing import Callable

from hf_tune.catalog.late_bound import resolve


@dataclasses.dataclass(frozen=True)
class SearchBackend:
    name: str
    title: str  # as the summary names it
    run: str  # "module:function": recipe -> summary dict
    read_trials: str  # "module:function": study folder -> its trials (hf-tune compare)
    package: str | None = None  # the import its studies need beyond hf_tune's own (None: Optuna, always installed)
    extra: str | None = None  # the hf_tune extra that installs it
    samplers: tuple[str, ...] = ()  # the search.sampler values it runs; empty: every one (Optuna's)
    objectives: int | None = None  # the metrics one study optimises at most (None: any number)
    prunes: bool = False  # search.pruner (Optuna's pruners)
    cross_validates: bool = False  # search.cv
    dashboard: bool = False  # hf-tune search --dashboard (optuna-dashboard)
    own_keys: tuple[str, ...] = ()  # search keys only this backend reads

    def load(self, which: str) -> Callable:
        """``run`` or ``read_trials``, imported now."""
        return resolve(getattr(self, which))


SEARCH_BACKENDS = {backend.name: backend for backend in (
    SearchBackend("optuna", "Optuna", run="hf_tune.search.trials:search",
                  read_trials="hf_tune.search.optuna_summary:read_trials", prunes=True, cross_validates=True,
                  dashboard=True),
    SearchBackend("ray", "Ray Tune", run="hf_tune.search.ray_backend:search_with_ray",
                  read_trials="hf_tune.search.ray_summary:read_trials", package="ray", extra="ray",
                  samplers=("tpe", "random", "grid"), objectives=1,
                  own_keys=("scheduler", "ray_address", "scheduler_kwargs", "resources_per_trial")),
)}
DEFAULT_SEARCH_BACKEND = "optuna"
