"""The recipe's ``search`` section: the space (a distribution per dotted recipe key) and the study's settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from hf_tune.catalog.search_backends import DEFAULT_SEARCH_BACKEND, SEARCH_BACKENDS
from hf_tune.recipe.section import Section


class Distribution(Section):
    """One search dimension: ``{type: float, low, high, log}``, ``{type: int, low, high, step}``,
    ``{type: categorical, choices: [...]}``."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None
    when: dict[str, Any] | None = Field(
        default=None, description="search this key only in trials where these keys (searched, or set in the recipe) "
                                  "have these values; a list: one of those values (hf_tune.recipe.search_space)")

    @property
    def first_value(self) -> Any:
        """The first choice, or the low end in the declared type: the value a recipe is checked with."""
        return self.choices[0] if self.type == "categorical" else int(self.low) if self.type == "int" else self.low

    @model_validator(mode="after")
    def _consistent(self) -> "Distribution":
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical distribution needs a non-empty 'choices' list")
            return self
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} distribution needs 'low' and 'high'")
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is greater than high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0, got {self.low:g}")
        if self.log and self.step is not None:
            raise ValueError("'step' and 'log' cannot be used together")
        return self


class SearchSection(Section):
    """Hyperparameter search (Optuna through ``Trainer.hyperparameter_search``)."""

    space: dict[str, Distribution] = Field(description="dotted recipe key -> distribution, e.g. training.learning_rate")
    metric: str | list[str] = Field(default="eval_loss", description="a metric, or a list for multi-objective")
    directions: Literal["minimize", "maximize"] | list[Literal["minimize", "maximize"]] | None = Field(
        default=None, description="default: minimize losses and parameter counts, maximize other metrics")
    n_trials: PositiveInt = 10
    timeout: PositiveFloat | None = Field(default=None, description="seconds; no new trial starts after it")
    sampler: Literal["tpe", "random", "cmaes", "nsga2", "grid", "gp"] = "tpe"
    sampler_kwargs: dict[str, Any] = Field(default_factory=dict, description="arguments of the Optuna sampler class, "
                                           "e.g. n_startup_trials for tpe (Optuna's default: 10 random trials first)")
    pruner: Literal["median", "hyperband", "wilcoxon", "none"] = Field(
        default="median", description="default median; wilcoxon (and the default) with cv: a paired test, fold by fold")
    pruner_kwargs: dict[str, Any] = Field(default_factory=dict, description="arguments of the Optuna pruner class")
    cv: int | None = Field(default=None, ge=2, description="k: each trial's value is the mean of its metric over k "
                                                          "stratified folds of data.train (scikit-learn's cv=k)")
    terminator: Literal["none", "stagnation", "regret_bound", "emmr"] = Field(
        default="none", description="stop the study once more trials are unlikely to beat the best "
                                    "(Optuna's Terminator)")
    terminator_kwargs: dict[str, Any] = Field(default_factory=dict,
                                              description="e.g. max_stagnation_trials, min_n_trials")
    backend: Literal[tuple(SEARCH_BACKENDS)] = Field(  # type: ignore[valid-type]  the table's names
        default=DEFAULT_SEARCH_BACKEND, description="optuna, or ray (Ray Tune: ASHA, PBT): the table in "
                                                    "hf_tune.catalog.search_backends")
    scheduler: Literal["asha", "pbt", "none"] | None = Field(
        default=None, description="backend ray: the trial scheduler (default asha)")
    scheduler_kwargs: dict[str, Any] = Field(default_factory=dict, description="backend ray: the scheduler's arguments")
    resources_per_trial: dict[str, float] = Field(default_factory=dict,
                                                  description="backend ray: e.g. {cpu: 2, gpu: 1} per trial")
    ray_address: str | None = Field(default=None, description="backend ray: a cluster to join (default: RAY_ADDRESS, "
                                                              "else a local Ray started for the study)")
    seed: int = 42
    storage: str | None = Field(default=None, description="Optuna storage URL or a .log journal file; default: "
                                                          "sqlite in the study folder")
    study_name: str | None = Field(default=None, description="default: the recipe file's name")
    output_dir: str | None = Field(default=None, description="the study folder; default: training.output_dir")

    @model_validator(mode="before")
    @classmethod
    def _wilcoxon_with_cv(cls, data: Any) -> Any:
        """With cv a trial's steps are its folds: the pruner defaults to wilcoxon, which pairs them."""
        if isinstance(data, dict) and data.get("cv") is not None and "pruner" not in data:
            return {**data, "pruner": "wilcoxon"}
        return data
