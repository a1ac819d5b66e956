"""What a trial samples and how: the space's values in their declared types, the recipe a trial's values make, the
sampler (seeded per trial), the pruner, the Terminator, and the direction of each objective."""

from __future__ import annotations

import logging
from typing import Any

import optuna

from hf_tune.errors import RecipeError
from hf_tune.recipe.checks import search_metrics
from hf_tune.recipe.overrides import apply_values
from hf_tune.recipe.schema import Distribution, Recipe, SearchSection
from hf_tune.recipe.search_space import decode_choice, encoded_choices, sample_space
from hf_tune.recipe.validation import validate_recipe

logger = logging.getLogger(__name__)
LOWER_IS_BETTER = ("loss", "perplexity", "trainable_params")


def directions_for(search: SearchSection) -> list[str]:
    """One direction per metric: the recipe's, or minimize for losses, perplexities and sizes, maximize otherwise."""
    metrics = search_metrics(search)
    if search.directions is not None:
        return search.directions if isinstance(search.directions, list) else [search.directions] * len(metrics)
    return ["minimize" if m.endswith(LOWER_IS_BETTER) else "maximize" for m in metrics]


def suggest(trial, key: str, dist: Distribution):
    """The trial's value for ``key``, decoded (a list or mapping choice is suggested as its JSON text)."""
    if dist.type == "categorical":
        return decode_choice(dist, trial.suggest_categorical(key, encoded_choices(dist)))
    if dist.type == "int":
        return trial.suggest_int(key, int(dist.low), int(dist.high), step=int(dist.step or 1), log=dist.log)
    return trial.suggest_float(key, dist.low, dist.high, step=dist.step, log=dist.log)


def sample_trial(trial, space: dict[str, Distribution], raw: dict[str, Any]) -> dict[str, Any]:
    """The trial's ``{dotted key: value}`` in declared types: the keys whose condition holds (``raw``: the recipe the
    trial starts from). Optuna returns the same value when a trial suggests a key again."""
    return sample_space(space, raw, lambda key, dist: typed(dist, suggest(trial, key, dist)))


def params_to_values(space: dict[str, Distribution], params: dict[str, Any]) -> dict[str, Any]:
    """A finished trial's Optuna params as the recipe values they stand for (decoded, in declared types)."""
    return {key: typed(space[key], decode_choice(space[key], value)) for key, value in params.items() if key in space}


def typed(dist: Distribution, value: Any) -> Any:
    """The value in its declared type: Trainer casts trial values to the type of the current argument (an int
    ``warmup_steps`` would turn 0.26 into 0), so hf_tune converts to what the space declares instead."""
    return int(value) if dist.type == "int" else float(value) if dist.type == "float" else value


def trial_recipe(base: Recipe, values: dict[str, Any]) -> Recipe:
    """``base`` with a trial's ``{dotted key: value}`` applied, validated again, without its search section."""
    raw = {k: v for k, v in base.to_dict().items() if k != "search"}
    return validate_recipe(apply_values(raw, values), base.source)


def make_sampler(search: SearchSection, ask_and_tell: bool = False):
    """The study's sampler, seeded per trial: trial k samples with seed + k, whichever process runs it, so a study
    reproduces from its seed and two workers starting together never propose the same values. The grid sampler keeps
    one seed: it shuffles the grid with it, and the grid ids in the storage must keep meaning the same points.
    ``ask_and_tell``: for trials run by ``study.ask`` / ``study.tell`` rather than ``Study.optimize``."""
    if search.sampler == "grid":
        grid = {}
        for key, d in search.space.items():
            if d.type == "categorical":
                grid[key] = encoded_choices(d)
            else:
                step = d.step or 1
                count = int(round((d.high - d.low) / step)) + 1
                grid[key] = [typed(d, d.low + i * step) for i in range(count)]
        return (AskAndTellGridSampler if ask_and_tell else optuna.samplers.GridSampler)(grid, seed=search.seed)
    kind = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
            "cmaes": optuna.samplers.CmaEsSampler, "nsga2": optuna.samplers.NSGAIISampler,
            "gp": optuna.samplers.GPSampler}[search.sampler]
    kwargs = dict(search.sampler_kwargs)
    kwargs.pop("seed", None)  # search.seed seeds each trial
    try:
        kind(**kwargs)
    except TypeError as err:
        raise RecipeError("search.sampler_kwargs", str(err)) from None
    return TrialSeededSampler(lambda seed: kind(seed=seed, **kwargs), search.seed)


class AskAndTellGridSampler(optuna.samplers.GridSampler):
    """The grid sampler for ask and tell: once the grid is visited, Optuna's calls ``study.stop()``, which only
    ``Study.optimize`` allows; the loop stops at search.n_trials instead (as the optimize loop of one trial does)."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


class TrialSeededSampler(optuna.samplers.BaseSampler):
    """Delegates to a sampler made for each trial with ``seed + trial.number`` (known once the trial exists)."""

    def __init__(self, factory, seed: int):
        self.factory, self.seed = factory, seed
        self.inner = factory(seed)

    def before_trial(self, study, trial):
        self.inner = self.factory(self.seed + trial.number)
        self.inner.before_trial(study, trial)

    def infer_relative_search_space(self, study, trial):
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values):
        self.inner.after_trial(study, trial, state, values)


def make_pruner(search: SearchSection):
    """The Optuna pruner of ``search.pruner``; wilcoxon (a cross-validated search) pairs a trial's fold values with
    the best trial's same folds (Optuna's defaults: p_threshold 0.1, n_startup_steps 2)."""
    import warnings

    kinds = {"median": optuna.pruners.MedianPruner, "hyperband": optuna.pruners.HyperbandPruner,
             "wilcoxon": optuna.pruners.WilcoxonPruner, "none": optuna.pruners.NopPruner}
    kwargs = search.pruner_kwargs
    if search.pruner == "median":
        kwargs = {"n_startup_trials": 2, **kwargs}  # Optuna's 5 would prune nothing in a small study
    with warnings.catch_warnings():  # Optuna marks WilcoxonPruner experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        try:
            return kinds[search.pruner](**kwargs)
        except (TypeError, ValueError) as err:
            raise RecipeError("search.pruner_kwargs", str(err)) from None


def warn_if_random_search(search: SearchSection) -> None:
    """TPE and GP sample their first ``n_startup_trials`` (Optuna's default: 10) at random: a study no longer than
    that is a random search, whatever it says. Said once per search."""
    startup = search.sampler_kwargs.get("n_startup_trials", 10)
    if search.sampler in ("tpe", "gp") and startup >= search.n_trials:
        logger.warning("search: %s samples its first %d trials at random, and search.n_trials is %d, so this study "
                       "is a random search; set search.sampler_kwargs.n_startup_trials below n_trials",
                       search.sampler.upper(), startup, search.n_trials)


def make_terminator(search: SearchSection, cross_validated: bool = False):
    """Optuna's Terminator for ``search.terminator`` (None for none): it stops the study once the room left for
    improvement (the evaluator's estimate) falls below the objective's noise. ``stagnation``: no better trial for
    ``max_stagnation_trials``; ``regret_bound`` / ``emmr``: Gaussian-process estimates, with the noise taken from
    the folds' scores under cross-validation, else from the median of the early estimates (MedianErrorEvaluator)."""
    if search.terminator == "none":
        return None
    import warnings

    from optuna import terminator as t

    kwargs = dict(search.terminator_kwargs)
    min_n_trials = kwargs.pop("min_n_trials", None)
    median = {k: kwargs.pop(k) for k in ("warm_up_trials", "n_initial_trials", "threshold_ratio") if k in kwargs}
    kind = {"regret_bound": t.RegretBoundEvaluator, "emmr": t.EMMREvaluator,
            "stagnation": t.BestValueStagnationEvaluator}[search.terminator]
    with warnings.catch_warnings():  # Optuna marks the terminator module deprecated (removal planned for 6.0)
        warnings.simplefilter("ignore", FutureWarning)
        try:
            improvement = kind(**kwargs)
            if search.terminator == "stagnation":
                error = t.StaticErrorEvaluator(0.0)
            elif cross_validated:
                error = t.CrossValidationErrorEvaluator()
            else:
                error = t.MedianErrorEvaluator(improvement, **median)
            default_min = 1 if search.terminator == "stagnation" else t.improvement.evaluator.DEFAULT_MIN_N_TRIALS
            return t.Terminator(improvement, error, min_n_trials=min_n_trials or default_min)
        except (TypeError, ValueError) as err:
            raise RecipeError("search.terminator_kwargs", str(err)) from None
