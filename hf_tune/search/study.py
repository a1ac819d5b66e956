"""Hyperparameter search from the recipe's ``search`` section: ``Trainer.hyperparameter_search`` with Optuna.

Each trial rebuilds the model (and the optimizer groups) from the recipe with the trial's values, so any model,
LoRA or optim key can be searched, not only ``TrainingArguments``. The study lives in an Optuna storage (SQLite in
the study folder by default), so rerunning the same command continues it, and several processes or machines
pointed at one storage share its trials. ``python -m hf_tune.search RECIPE [overrides]`` (hf_tune/search/__main__.py) runs
it under any launcher.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
import yaml

from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.recipe.checks import search_metrics
from hf_tune.recipe.loading import Recipe, apply_values, redact_secrets, validate_recipe
from hf_tune.recipe.schema import Distribution, SearchSection

logger = logging.getLogger(__name__)
# what Optuna's best-trial lookup raises while no trial has completed (a database storage, the others)
NO_BEST_TRIAL = {"Record does not exist.", "No trials are completed yet."}
LOWER_IS_BETTER = ("loss", "perplexity", "trainable_params")


def directions_for(search: SearchSection) -> list[str]:
    metrics = search_metrics(search)
    if search.directions is not None:
        return search.directions if isinstance(search.directions, list) else [search.directions] * len(metrics)
    return ["minimize" if m.endswith(LOWER_IS_BETTER) else "maximize" for m in metrics]


def suggest(trial, key: str, dist: Distribution):
    if dist.type == "categorical":
        return trial.suggest_categorical(key, dist.choices)
    if dist.type == "int":
        return trial.suggest_int(key, int(dist.low), int(dist.high), step=int(dist.step or 1), log=dist.log)
    return trial.suggest_float(key, dist.low, dist.high, step=dist.step, log=dist.log)


def typed(dist: Distribution, value: Any) -> Any:
    """The value in its declared type: Trainer casts trial values to the type of the current argument (an int
    ``warmup_steps`` would turn 0.26 into 0), so hf_tune converts to what the space declares instead."""
    return int(value) if dist.type == "int" else float(value) if dist.type == "float" else value


def make_storage(search: SearchSection, study_dir: Path):
    url = search.storage or f"sqlite:///{(study_dir / 'study.db').resolve()}"
    if url.endswith((".log", ".journal")):  # a journal file: NFS-friendly, several workers
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url))
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        return open_rdb(url)
    # A new SQLite file: the processes open it one at a time (see open_rdb), so none waits out a locked database.
    from filelock import FileLock

    path = Path(url.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        return open_rdb(url)


def open_rdb(url: str, attempts: int = 5):
    """An Optuna database storage. Optuna writes a new database's schema on first open, and processes doing that at
    once (workers started together on a new study) fail with "table studies already exists" or "UNIQUE constraint
    failed: alembic_version": the schema is there when the loser tries again. Heartbeats let a restarted study mark
    the trials of a killed worker as failed instead of running forever."""
    import random

    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=90)
        except (OperationalError, IntegrityError, ProgrammingError, StorageInternalError) as err:
            if attempt == attempts - 1:
                raise HfTuneError(f"search.storage: could not open {redact_url(url)} ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0]})\n  fix: check that the database server is reachable "
                                  "and the URL's user may create tables") from err
            time.sleep(0.2 * (attempt + 1) * (1 + random.random()))


def redact_url(url: str) -> str:
    """The URL without its password (errors and logs must not carry it)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy can parse: say nothing of it
        return "the storage URL"


def make_sampler(search: SearchSection):
    """The study's sampler, seeded per trial: trial k samples with seed + k, whichever process runs it, so a study
    reproduces from its seed and two workers starting together never propose the same values. The grid sampler keeps
    one seed: it shuffles the grid with it, and the grid ids in the storage must keep meaning the same points."""
    if search.sampler == "grid":
        grid = {}
        for key, d in search.space.items():
            if d.type == "categorical":
                grid[key] = d.choices
            else:
                step = d.step or 1
                count = int(round((d.high - d.low) / step)) + 1
                grid[key] = [typed(d, d.low + i * step) for i in range(count)]
        return optuna.samplers.GridSampler(grid, seed=search.seed)
    kind = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
            "cmaes": optuna.samplers.CmaEsSampler, "nsga2": optuna.samplers.NSGAIISampler}[search.sampler]
    kwargs = dict(search.sampler_kwargs)
    kwargs.pop("seed", None)  # search.seed seeds each trial
    try:
        kind(**kwargs)
    except TypeError as err:
        raise RecipeError("search.sampler_kwargs", str(err)) from None
    startup = kwargs.get("n_startup_trials", 10)
    if search.sampler == "tpe" and startup >= search.n_trials:
        logger.warning("search: TPE samples its first %d trials at random, and search.n_trials is %d, so this study "
                       "is a random search; set search.sampler_kwargs.n_startup_trials below n_trials", startup,
                       search.n_trials)
    return TrialSeededSampler(lambda seed: kind(seed=seed, **kwargs), search.seed)


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
    kinds = {"median": optuna.pruners.MedianPruner, "hyperband": optuna.pruners.HyperbandPruner,
             "none": optuna.pruners.NopPruner}
    kwargs = search.pruner_kwargs
    if search.pruner == "median":
        kwargs = {"n_startup_trials": 2, **kwargs}  # Optuna's 5 would prune nothing in a small study
    try:
        return kinds[search.pruner](**kwargs)
    except TypeError as err:
        raise RecipeError("search.pruner_kwargs", str(err)) from None


def trial_recipe(base: Recipe, values: dict[str, Any]) -> Recipe:
    raw = {k: v for k, v in base.to_dict().items() if k != "search"}
    return validate_recipe(apply_values(raw, values), base.source)


def search(recipe: Recipe) -> dict:
    """Run (or continue) the study; write trials.csv, plots, best_recipe.yaml into the study folder."""
    from transformers import Trainer

    from hf_tune.data import build_datasets, dataset_labels
    from hf_tune.distributed import fit_cpu_threads
    from hf_tune.modeling import build_model, build_tokenizer
    from hf_tune.trainer import build_trainer
    from hf_tune.training_args import build_training_arguments

    if recipe.search is None:
        raise RecipeError("search", "the recipe has no search section", fix="add search.space (see the README)")
    spec = recipe.search
    study_dir = Path(spec.output_dir or recipe.training["output_dir"])
    study_name = spec.study_name or (recipe.source.stem if recipe.source else "study")
    metrics, directions = search_metrics(spec), directions_for(spec)
    multi = len(metrics) > 1

    training = {**recipe.training, "output_dir": str(study_dir)}
    for key, dist in spec.space.items():  # the base value in the declared type: Trainer's cast is then harmless
        if key.startswith("training.") and dist.type != "categorical":
            training[key.removeprefix("training.")] = typed(dist, dist.low)
    base = dataclasses.replace(recipe, training=training, search=None)
    args = build_training_arguments(base)
    fit_cpu_threads(args)
    tokenizer = build_tokenizer(base)
    labels = dataset_labels(base)
    train_dataset, eval_dataset = build_datasets(base, tokenizer, args)
    trainer: Any = None

    def sample(trial) -> dict[str, Any]:  # Optuna returns the same value when a trial suggests a key again
        return {key: typed(dist, suggest(trial, key, dist)) for key, dist in spec.space.items()}

    def model_init(trial=None):  # Trainer calls it before hp_space: it samples the trial's values itself
        current = base
        if trial is not None:
            if trial.number >= spec.n_trials:  # every rank holds the number: rank 0's trial, the others' copy
                raise SurplusTrial(trial.number, spec.n_trials)
            values = sample(trial)
            logger.info("rank %d of %d: trial %s with %s", args.process_index, args.world_size, trial.number,
                        values)
            current = trial_recipe(base, values)
            trainer.optim = current.optim  # the groups of this trial's optimizer
        model = build_model(current, tokenizer, labels)
        if trial is not None and hasattr(trial, "set_user_attr"):
            trial.set_user_attr("trainable_params", trainable_params(model))
        return model

    def hp_space(trial) -> dict[str, Any]:
        return {k.removeprefix("training."): v for k, v in sample(trial).items() if k.startswith("training.")}

    def compute_objective(results: dict[str, float]):
        missing = [m for m in metrics if m != "trainable_params" and m not in results]
        if missing:
            raise HfTuneError(f"search.metric: {missing} not in the evaluation results {sorted(results)}")
        values = [float(trainable_params(trainer.model)) if m == "trainable_params" else results[m] for m in metrics]
        return values if multi else values[0]

    trainer = build_trainer(base, None, tokenizer, train_dataset, eval_dataset, args, model_init=model_init)
    # only the main process talks to Optuna; the other ranks train the trial it broadcasts
    storage = make_storage(spec, study_dir) if trainer.is_world_process_zero() else None
    if trainer.is_world_process_zero():
        study_dir.mkdir(parents=True, exist_ok=True)
    # Only rank 0 holds the Optuna trial (the others train a copy of its values): a trial that fails on one rank
    # leaves the others in a collective it never joins, so under several processes an error stops the launch.
    # Pruning is decided on rank 0 and followed by every rank (HfTuneTrainer._report_to_hp_search).
    distributed = args.world_size > 1
    pruner = make_pruner(spec)
    if distributed and not hasattr(Trainer, "_report_to_hp_search"):
        # that override is how every rank follows rank 0: without it a pruned trial would hang the other ranks
        logger.warning("search: this transformers version reports trials another way, so under %d processes pruning "
                       "is off (search.pruner: %s is ignored)", args.world_size, spec.pruner)
        pruner = optuna.pruners.NopPruner()
    started = time.time()
    while _another_trial(trainer, storage, study_name, directions, spec, started):
        try:
            trainer.hyperparameter_search(
                hp_space=hp_space, compute_objective=compute_objective, n_trials=1,
                direction=directions if multi else directions[0], backend="optuna",
                hp_name=lambda trial: f"trial-{trial.number}", study_name=study_name, storage=storage,
                load_if_exists=True, sampler=make_sampler(spec), pruner=pruner,
                catch=(SurplusTrial,) if distributed else (Exception,), gc_after_trial=True,
            )
        except (optuna.TrialPruned, SurplusTrial):  # the other ranks: upstream's loop for them lets these out
            if trainer.is_world_process_zero():
                raise
        except ValueError as err:  # upstream asks for the best trial, and none has completed yet (pruned or failed)
            if str(err) not in NO_BEST_TRIAL:  # any other ValueError (one from training) is the trial's to report
                raise
    if not trainer.is_world_process_zero():
        return {}
    return summarize(optuna.load_study(study_name=study_name, storage=storage), recipe, metrics, study_dir)


class SurplusTrial(HfTuneError):
    """A trial created after the study reached n_trials: workers that checked the count at the same moment each
    started one. It fails at once, before any training, so the study runs n_trials trials and not up to
    n_trials + workers - 1. Every rank raises it at the same point, so it is safe to catch under DDP."""

    def __init__(self, number: int, n_trials: int):
        super().__init__(f"search: trial {number} not run: the study already has search.n_trials={n_trials} trials "
                         "(other workers started theirs at the same moment)")
        self.number, self.n_trials = number, n_trials

    def __reduce__(self):
        return type(self), (self.number, self.n_trials)


def trainable_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _another_trial(trainer, storage, study_name: str, directions: list[str], spec: SearchSection,
                   started: float) -> bool:
    """Rank 0 decides from the shared storage (trials finished or running anywhere count); other ranks follow."""
    go = False
    if trainer.is_world_process_zero():
        study = optuna.create_study(study_name=study_name, storage=storage, load_if_exists=True,
                                    directions=directions)
        go = len(study.trials) < spec.n_trials and (spec.timeout is None or time.time() - started < spec.timeout)
    if trainer.args.world_size > 1:
        import torch.distributed as dist

        decision = [go]
        dist.broadcast_object_list(decision, src=0)
        go = decision[0]
    return go


def summarize(study, recipe: Recipe, metrics: list[str], study_dir: Path) -> dict:
    with warnings.catch_warnings():  # trials of killed workers (no heartbeat for a while) are failed first
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
    trials = [{"number": t.number, "state": t.state.name, "values": t.values, "params": t.params,
               "trainable_params": t.user_attrs.get("trainable_params"),
               "error": t.user_attrs.get("error")} for t in study.trials]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    result: dict[str, Any] = {"study_name": study.study_name, "metrics": metrics, "trials": trials,
                              "study_dir": str(study_dir)}
    running = [t.number for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    if not complete and running:  # other workers are still training: the last one to finish writes the summary
        logger.info("search: no trial has completed yet; trial(s) %s still run in other workers (or, with a journal "
                    "file, which has no heartbeat, were left running by a killed one)", running)
        return {**result, "best": [], "running": running}
    if not complete:
        raise HfTuneError(f"search: none of the {len(trials)} trials completed; see the errors in {study_dir}")
    best = study.best_trials if len(metrics) > 1 else [study.best_trial]
    result["best"] = [{"number": t.number, "values": t.values, "params": t.params} for t in best]
    spec = recipe.search
    best_values = {k: typed(spec.space[k], v) for k, v in best[0].params.items()}
    best_recipe = trial_recipe(dataclasses.replace(recipe, training={**recipe.training,
                                                                     "output_dir": str(study_dir / "best")}),
                               best_values)
    path = study_dir / "best_recipe.yaml"
    raw = {k: v for k, v in redact_secrets(best_recipe.to_dict()).items() if k != "search"}
    path.write_text(f"# best trial {best[0].number} of study {study.study_name}: {dict(zip(metrics, best[0].values))}\n"
                    + yaml.safe_dump(raw, sort_keys=False))
    result["best_recipe"] = str(path)
    study.trials_dataframe().to_csv(study_dir / "trials.csv", index=False)
    result["plots"] = write_plots(study, metrics, study_dir)
    return result


def write_plots(study, metrics: list[str], study_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ov

    multi = len(metrics) > 1
    plots = {"optimization_history.png": lambda: ov.plot_optimization_history(
        study, target=(lambda t: t.values[0]) if multi else None, target_name=metrics[0]),
        "param_importances.png": lambda: ov.plot_param_importances(
            study, target=(lambda t: t.values[0]) if multi else None, target_name=metrics[0])}
    if multi:
        plots["pareto_front.png"] = lambda: ov.plot_pareto_front(study, target_names=metrics)
    written = []
    for name, draw in plots.items():
        try:
            axes = draw()
            figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
            figure.set_size_inches(8, 5)
            figure.tight_layout()
            figure.savefig(study_dir / name, dpi=100)
            plt.close(figure)
            written.append(str(study_dir / name))
        except Exception as err:  # e.g. importances need two finished trials that differ
            logger.warning("search: no %s (%s)", name, err)
    return written


def format_summary(result: dict) -> str:
    lines = [f"study {result['study_name']} in {result['study_dir']}: {len(result['trials'])} trials", "",
             f"{'#':>3} {'state':<9} {', '.join(result['metrics']):<24} params"]
    for t in result["trials"]:
        values = ", ".join(f"{v:.4g}" for v in t["values"]) if t["values"] else "-"
        lines.append(f"{t['number']:>3} {t['state']:<9} {values:<24} {t['params']}"
                     + (f"\n      error: {t['error']}" if t["error"] else ""))
    if result.get("running"):
        lines.append(f"\nno trial has completed yet; running in other workers: {result['running']} (with a journal "
                     "file, possibly left so by a killed worker). The worker that finishes last writes the best "
                     "recipe.")
        return "\n".join(lines)
    for b in result["best"]:
        lines.append(f"\nbest: trial {b['number']} {dict(zip(result['metrics'], b['values']))} {b['params']}")
    lines.append(f"best recipe: {result['best_recipe']}  (python -m hf_tune.run {result['best_recipe']})")
    lines += [f"plot: {p}" for p in result["plots"]]
    return "\n".join(lines)
