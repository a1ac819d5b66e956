"""``search.backend: ray``: the study runs on Ray Tune, whose schedulers do what Optuna does not: ASHA (asynchronous
successive halving over many workers) and population-based training (PBT: a weak trial copies a strong trial's
checkpoint and goes on with mutated hyperparameters).

Each trial is a Ray Tune function trainable (``ray_trial.run_trial``) that builds the trial's recipe and trains it
with hf_tune's own ``Trainer`` (the data is tokenized once, on the driver, and shared through Ray's object store).
Every evaluation is reported to Ray; under PBT with the complete checkpoint saved at that step (``checkpoint-N`` with
its marker), so a trial that exploits another copies that checkpoint into its own folder and resumes from it exactly
as a rerun would, with its mutated values applied to the optimizer it loads (``hf_tune.optim.resume``). The study
folder gets the same outputs as the Optuna backend, by the same writer (``summarize_ray``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from hf_tune.assembly.run_build import build_data
from hf_tune.errors import HfTuneError
from hf_tune.model import build_tokenizer
from hf_tune.recipe.schema import Distribution, Recipe, SearchSection
from hf_tune.search.backend import StudyPaths, base_recipe, study_paths
from hf_tune.search.ray_summary import summarize_ray
from hf_tune.search.ray_trial import run_trial
from hf_tune.search.sampling import directions_for, typed
from hf_tune.training_args import build_training_arguments

logger = logging.getLogger(__name__)


def import_ray():
    try:
        import ray
        from ray import tune
    except ImportError as err:
        raise HfTuneError("search.backend: ray needs Ray Tune, which is not installed\n  fix: pip install "
                          "'hf_tune[ray]'") from err
    return ray, tune


def ray_domain(dist: Distribution):
    """The Ray Tune domain sampling ``dist`` (bounds inclusive, as in the Optuna backend)."""
    _, tune = import_ray()
    if dist.type == "categorical":
        return tune.choice(list(dist.choices))
    if dist.type == "int":
        low, high = int(dist.low), int(dist.high)
        if dist.log:
            return tune.lograndint(low, high + 1)
        return tune.qrandint(low, high, int(dist.step or 1))
    if dist.log:
        return tune.loguniform(dist.low, dist.high)
    return tune.quniform(dist.low, dist.high, dist.step) if dist.step else tune.uniform(dist.low, dist.high)


def absolute_paths(recipe: Recipe) -> Recipe:
    """The recipe with its local files named absolutely: Ray workers run in other folders (or on other hosts that
    mount the same paths)."""
    data = recipe.data.model_copy(deep=True)
    for name in ("train", "eval"):
        source = getattr(data, name)
        if source is not None and os.path.exists(source.path):
            source.path = str(Path(source.path).resolve())
    model = recipe.model.model_copy(deep=True)
    if os.path.isdir(model.pretrained_model_name_or_path):
        model.pretrained_model_name_or_path = str(Path(model.pretrained_model_name_or_path).resolve())
    if data.chat_template and os.path.isfile(data.chat_template):
        data.chat_template = str(Path(data.chat_template).resolve())
    return dataclasses.replace(recipe, data=data, model=model)


# ---- on the driver ------------------------------------------------------------------------------------------------

def search_with_ray(recipe: Recipe) -> dict:
    """Run the study on Ray Tune (a cluster at search.ray_address / RAY_ADDRESS, or a local Ray started and stopped
    here); write trials.csv, plots and best_recipe.yaml into the study folder."""
    ray, tune = import_ray()
    from ray.tune.search.basic_variant import BasicVariantGenerator

    spec, found = recipe.search, study_paths(recipe)
    paths = StudyPaths(found.folder.resolve(), found.name)  # Ray's workers run in other folders
    study_dir = paths.folder
    base = base_recipe_for_ray(recipe, study_dir)
    args = build_training_arguments(base)
    data = build_data(base, build_tokenizer(base), args)  # read (sft: tokenized) once, for every trial
    study_dir.mkdir(parents=True, exist_ok=True)
    metric, mode = spec.metric if isinstance(spec.metric, str) else spec.metric[0], directions_for(spec)[0][:3]
    evaluations = evaluations_per_trial(base)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=base, spec=spec, data=data, study_dir=str(study_dir)),
        resources_per_trial(spec))
    started_here = connect(ray, spec)
    try:
        tuner = tune.Tuner(
            trainable, param_space=param_space(spec),
            tune_config=tune.TuneConfig(metric=metric, mode=mode,
                                        num_samples=1 if spec.sampler == "grid" else spec.n_trials,
                                        scheduler=make_scheduler(spec, metric, mode, evaluations),
                                        search_alg=BasicVariantGenerator(
                                            random_state=spec.seed,
                                            max_concurrent=spec.scheduler_kwargs.get("max_concurrent_trials", 0)),
                                        # a fresh actor per trial: a reused one kept the models of the trials
                                        # it ran before (PBT's peak actor RSS: benchmarks/RESULTS.md)
                                        time_budget_s=spec.timeout, reuse_actors=False),
            run_config=tune.RunConfig(name=paths.name, storage_path=str(study_dir / "ray"), verbose=0,
                                      stop=stop_rule(base),
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=None)))
        grid = tuner.fit()
        return summarize_ray(grid, recipe, metric, mode, paths)
    finally:
        if started_here:
            ray.shutdown()


def param_space(spec: SearchSection) -> dict[str, Any]:
    """Ray's space: a domain per key, or with sampler grid every combination of the categorical choices once."""
    _, tune = import_ray()
    if spec.sampler == "grid":
        return {key: tune.grid_search(list(dist.choices)) for key, dist in spec.space.items()}
    return {key: ray_domain(dist) for key, dist in spec.space.items()}


def base_recipe_for_ray(recipe: Recipe, study_dir: Path) -> Recipe:
    """The recipe every trial starts from (``backend.base_recipe``) with its local paths absolute, and under PBT a
    complete checkpoint at every evaluation (what a trial exploits)."""
    base = base_recipe(recipe, study_dir)
    if (recipe.search.scheduler or "asha") == "pbt":
        training = {**base.training, "save_strategy": "steps", "save_steps": base.training.get("eval_steps") or 500}
        base = dataclasses.replace(base, training=training)
    return absolute_paths(base)


def stop_rule(recipe: Recipe) -> dict[str, int] | None:
    """A trial ends at max_steps: after its last evaluation it is neither exploited nor continued."""
    steps = recipe.training.get("max_steps", -1)
    return {"step": steps} if steps and steps > 0 else None


def evaluations_per_trial(recipe: Recipe) -> int:
    """How many results a trial reports (ASHA's max_t): one per evaluation of a max_steps run."""
    steps, every = recipe.training.get("max_steps", -1), recipe.training.get("eval_steps")
    if steps and steps > 0 and every:
        every = every if every >= 1 else max(int(every * steps), 1)
        return max(int(steps // every), 1)
    return 100


def resources_per_trial(spec: SearchSection) -> dict[str, float]:
    if spec.resources_per_trial:
        return dict(spec.resources_per_trial)
    import torch

    return {"cpu": 1, **({"gpu": 1} if torch.cuda.is_available() else {})}


def make_scheduler(spec: SearchSection, metric: str, mode: str, evaluations: int):
    """Ray Tune's scheduler for ``search.scheduler`` (asha by default), its arguments from scheduler_kwargs."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    kwargs = {k: v for k, v in spec.scheduler_kwargs.items() if k != "max_concurrent_trials"}
    kind = spec.scheduler or "asha"
    try:
        if kind == "none":
            return FIFOScheduler()
        if kind == "asha":
            return ASHAScheduler(**{"max_t": evaluations, "grace_period": 1, "reduction_factor": 2, **kwargs})
        mutations = {key: list(d.choices) if d.type == "categorical" else ray_domain(d)
                     for key, d in spec.space.items() if not shapes_weights(key)}
        # synch: every trial reaches the perturbation before any exploits, so a trial copies a checkpoint of the step
        # it is at (asynchronous PBT can hand it an older one, and two trials can then send each other back forever)
        return PopulationBasedTraining(**{"time_attr": "training_iteration", "perturbation_interval": 1,
                                          "synch": True, "hyperparam_mutations": mutations,
                                          "custom_explore_fn": InSpace(spec.space), **kwargs})
    except TypeError as err:
        raise HfTuneError(f"search.scheduler_kwargs: {err}") from None


def shapes_weights(key: str) -> bool:
    """lora and model keys shape the weights: PBT samples them once per trial and never mutates them, and a trial
    that exploits another takes the donor's along with its weights (Ray copies the donor's whole config)."""
    return key.split(".")[0] in ("lora", "model")


class InSpace:
    """PBT's explore step keeps values inside the declared space: a perturbed value (x 1.2 or x 0.8) beyond a bound
    is set to the bound, and an int key stays an int."""

    def __init__(self, space: dict[str, Distribution]):
        self.space = space

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        for key, dist in self.space.items():
            if dist.type != "categorical" and key in config and not shapes_weights(key):
                config[key] = typed(dist, min(max(config[key], dist.low), dist.high))
        return config


def connect(ray, spec: SearchSection) -> bool:
    """Join the cluster at search.ray_address or RAY_ADDRESS, or start a local Ray; True when started here (and so
    to be stopped, or disconnected from, here). A Ray already running in this process is used as it is."""
    if ray.is_initialized():
        return False
    address = spec.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return True  # ray.shutdown() then only disconnects this driver
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_CHDIR_TO_TRIAL_DIR": "0", "TOKENIZERS_PARALLELISM": "false"}})
    return True
