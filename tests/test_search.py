"""Hyperparameter search: real Optuna studies over real Trainer runs of a tiny Llama."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
from pathlib import Path

import launch
import optuna
import pytest
import yaml
from conftest import REPO, chat_recipe, free_port, write_recipe

from hf_tune import load_recipe, search, train
from hf_tune.errors import HfTuneError
from hf_tune.recipe.schema import SearchSection
from hf_tune.search import format_summary
from hf_tune.search.storage import make_storage, open_rdb, redact_url

LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}


def search_recipe(model_dir: str, out: Path, search_section: dict, lora: dict | None = LORA, **training) -> dict:
    settings = {"max_steps": 4, "per_device_train_batch_size": 4, "eval_strategy": "steps", "eval_steps": 2,
                "learning_rate": 1e-3, "seed": 7, **training}
    raw = chat_recipe(model_dir, out, **settings)
    raw["data"]["eval_split"] = 0.05
    raw["data"]["max_length"] = 64
    if lora:
        raw["lora"] = dict(lora)
    raw["search"] = {"n_trials": 4, "pruner": "none", **search_section}
    return raw


def lora_param_count(model_dir: str, r: int) -> int:
    """q_proj (hidden -> heads x head_dim) and v_proj (hidden -> kv_heads x head_dim), both adapted in every layer."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    per_layer = r * (hidden + heads * head_dim) + r * (hidden + kv * head_dim)
    return per_layer * config["num_hidden_layers"]


def test_study_over_learning_rate_and_lora_r_then_best_recipe_reproduces_the_best_trial(tmp_path, tiny_llama_dir):
    space = {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 3e-2, "log": True},
             "lora.r": {"type": "categorical", "choices": [2, 8]}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {"space": space, "sampler": "random"}, eval_steps=4)
    result = search(load_recipe(raw))

    assert [t["number"] for t in result["trials"]] == [0, 1, 2, 3]
    assert all(t["state"] == "COMPLETE" for t in result["trials"])
    for t in result["trials"]:
        assert t["trainable_params"] == lora_param_count(tiny_llama_dir, t["params"]["lora.r"])
    assert len({t["params"]["training.learning_rate"] for t in result["trials"]}) == 4
    values = [t["values"][0] for t in result["trials"]]
    best = result["best"][0]
    assert best["values"][0] == min(values)
    for name in ("best_recipe.yaml", "trials.csv", "optimization_history.png", "study.db"):
        assert (tmp_path / "study" / name).is_file(), name
    import matplotlib

    # Optuna's plots set the ggplot style: the process's later plots (a notebook's, hf_tune's) keep their own style
    assert matplotlib.rcParams["axes.prop_cycle"] == matplotlib.rcParamsDefault["axes.prop_cycle"]

    best_raw = yaml.safe_load(Path(result["best_recipe"]).read_text())
    assert "search" not in best_raw
    assert best_raw["lora"]["r"] == best["params"]["lora.r"]
    assert best_raw["training"]["learning_rate"] == best["params"]["training.learning_rate"]
    train(load_recipe(result["best_recipe"]))
    rerun = json.loads((tmp_path / "study" / "best" / "eval_results.json").read_text())
    assert rerun["eval_loss"] == pytest.approx(best["values"][0], abs=1e-5)


def test_hopeless_trials_are_pruned(tmp_path, tiny_llama_dir):
    space = {"training.learning_rate": {"type": "categorical", "choices": [3e-2, 1e-2, 1e-9, 2e-9]}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {
        "space": space, "sampler": "grid", "pruner": "median",
        "pruner_kwargs": {"n_startup_trials": 1, "n_warmup_steps": 0}}, lora=None, max_steps=6)
    result = search(load_recipe(raw))
    states = {t["params"]["training.learning_rate"]: t["state"] for t in result["trials"]}
    assert len(states) == 4
    assert "PRUNED" in states.values(), states
    assert all(t["error"] is None for t in result["trials"])  # a pruned trial is not a failed one
    assert all(state == "COMPLETE" for lr, state in states.items() if lr >= 1e-2)  # good trials run to the end


def test_a_failing_trial_is_recorded_with_its_error_and_the_study_goes_on(tmp_path, tiny_llama_dir):
    space = {"lora.r": {"type": "categorical", "choices": [4, 0]}}  # r=0 is refused when the trial's recipe loads
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {"space": space, "sampler": "grid", "n_trials": 2})
    result = search(load_recipe(raw))
    by_r = {t["params"]["lora.r"]: t for t in result["trials"]}
    assert by_r[4]["state"] == "COMPLETE" and by_r[4]["error"] is None
    assert by_r[0]["state"] == "FAIL" and "RecipeError" in by_r[0]["error"] and "lora.r" in by_r[0]["error"]
    assert result["best"][0]["params"] == {"lora.r": 4}


def test_rerunning_continues_the_study(tmp_path, tiny_llama_dir):
    space = {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {"space": space, "n_trials": 2}, lora=None)
    first = search(load_recipe(raw))
    raw["search"]["n_trials"] = 3
    second = search(load_recipe(raw))
    assert [t["number"] for t in first["trials"]] == [0, 1]
    assert [t["number"] for t in second["trials"]] == [0, 1, 2]
    assert second["trials"][:2] == first["trials"]  # finished trials are not rerun
    study = optuna.load_study(study_name="study", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    assert len(study.trials) == 3


def test_multi_objective_study_returns_the_pareto_front(tmp_path, tiny_llama_dir):
    space = {"lora.r": {"type": "categorical", "choices": [1, 4, 16]},
             "training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {
        "space": space, "metric": ["eval_loss", "trainable_params"], "sampler": "nsga2", "n_trials": 4})
    result = search(load_recipe(raw))
    points = {t["number"]: t["values"] for t in result["trials"] if t["state"] == "COMPLETE"}

    def dominated(a, b):  # b dominates a when it is no worse in both (minimised) objectives and better in one
        return all(y <= x for x, y in zip(a, b)) and any(y < x for x, y in zip(a, b))

    pareto = {n for n, v in points.items() if not any(dominated(v, w) for m, w in points.items() if m != n)}
    assert {b["number"] for b in result["best"]} == pareto
    assert (tmp_path / "study" / "pareto_front.png").stat().st_size > 5_000


@pytest.mark.parametrize("space, search_keys, message", [
    ({"lora.rr": {"type": "int", "low": 2, "high": 8}}, {}, "(?s)search.space.lora.rr: unknown key.*did you mean 'r'"),
    ({"training.learning_rate": {"type": "float", "low": 1e-2, "high": 1e-4}}, {}, "low .* is greater than high"),
    ({"training.learning_rate": {"type": "float", "low": 0.0, "high": 1e-2, "log": True}}, {}, "log scale needs low > 0"),
    ({"data.max_length": {"type": "int", "low": 32, "high": 64}}, {}, "search.space.data.max_length: cannot be searched"),
    ({"lora.r": {"type": "int", "low": 2, "high": 8}}, {"metric": "eval_accuracy"}, "search.metric: 'eval_accuracy'"),
    ({"lora.r": {"type": "int", "low": 2, "high": 8}}, {"pruner": "median", "metric": ["eval_loss", "trainable_params"]},
     "search.pruner: Optuna cannot prune multi-objective"),
])
def test_bad_search_sections_are_refused_at_load(tmp_path, tiny_llama_dir, space, search_keys, message):
    raw = search_recipe(tiny_llama_dir, tmp_path / "s", {"space": space, **search_keys})
    with pytest.raises(HfTuneError, match=message):
        load_recipe(raw)


def test_a_pruner_needs_periodic_evaluation(tmp_path, tiny_llama_dir):
    raw = search_recipe(tiny_llama_dir, tmp_path / "s", {"space": {"lora.r": {"type": "int", "low": 2, "high": 8}},
                                                         "pruner": "median"}, eval_strategy="no")
    with pytest.raises(HfTuneError, match="search.pruner: pruning needs evaluations"):
        load_recipe(raw)


@pytest.mark.slow
def test_two_workers_share_one_study_without_losing_or_repeating_trials(tmp_path, tiny_llama_dir):
    space = {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {"space": space, "n_trials": 4,
                                                             "storage": str(tmp_path / "journal.log")}, lora=None)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    workers = [launch.start("python", "-m", "hf_tune.search", str(recipe)) for _ in range(2)]
    outputs = [w.communicate(timeout=600) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-2000:] for _, err in outputs]
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "journal.log")))
    every = optuna.load_study(study_name="recipe", storage=storage).trials
    # both may find room for the last trial at once: the one numbered past n_trials fails unrun (see the next test)
    surplus = [t for t in every if "not run: the study already has" in t.user_attrs.get("error", "")]
    assert all(t.state == optuna.trial.TrialState.FAIL and t.number >= 4 for t in surplus)
    trials = [t for t in every if t not in surplus]
    assert [t.number for t in trials] == [0, 1, 2, 3]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert len({t.params["training.learning_rate"] for t in trials}) == 4
    ran = [line for _, err in outputs for line in err.splitlines() if "rank 0 of 1: trial" in line]
    assert len(ran) == 4 and all(sum(f"trial {n} with" in line for line in ran) == 1 for n in range(4))


# A worker that holds its first new trial until every worker has reached that point: each has then checked the
# trial count (and found room for one more) before any trial exists, the race that let workers overshoot n_trials.
HELD_WORKER = """
import os, sys, time
from pathlib import Path
from optuna.storages import RDBStorage
arrived, workers = Path(sys.argv[1]), int(sys.argv[2])
create_new_trial = RDBStorage._create_new_trial  # what the study's cached storage calls

def held(self, *args, **kwargs):
    if not arrived.joinpath(str(os.getpid())).exists():
        arrived.joinpath(str(os.getpid())).touch()
        deadline = time.time() + 300
        while len(list(arrived.iterdir())) < workers:
            assert time.time() < deadline, "the other workers never came"
            time.sleep(0.05)
    return create_new_trial(self, *args, **kwargs)

RDBStorage._create_new_trial = held
from hf_tune.search.__main__ import main
main(sys.argv[3:])
"""


def one_trial_study(tmp_path: Path, model_dir: str) -> tuple[Path, Path]:
    """A recipe for a study of n_trials: 1, and the empty folder where held workers say they arrived."""
    space = {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    raw = search_recipe(model_dir, tmp_path / "study", {"space": space, "n_trials": 1}, lora=None)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    (tmp_path / "arrived").mkdir()
    return recipe, tmp_path / "arrived"


@pytest.mark.slow
def test_workers_starting_trials_together_run_no_more_than_n_trials(tmp_path, tiny_llama_dir):
    recipe, arrived = one_trial_study(tmp_path, tiny_llama_dir)
    workers = [launch.start("python", "-c", HELD_WORKER, str(arrived), "2", str(recipe)) for _ in range(2)]
    outputs = [w.communicate(timeout=600) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-2000:] for _, err in outputs]
    assert len(list(arrived.iterdir())) == 2  # both held: both had found room for a trial
    trials = optuna.load_study(study_name="recipe", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL"]
    assert "trial 1 not run: the study already has search.n_trials=1 trials" in trials[1].user_attrs["error"]
    trained = [line for _, err in outputs for line in err.splitlines() if "rank 0 of 1: trial" in line]
    assert len(trained) == 1 and "trial 0 with" in trained[0], trained


@pytest.mark.slow
def test_two_ddp_launches_starting_trials_together_run_no_more_than_n_trials(tmp_path, tiny_llama_dir):
    """The surplus trial fails on both of its ranks at once; neither launch hangs."""
    recipe, arrived = one_trial_study(tmp_path, tiny_llama_dir)
    worker = tmp_path / "held_worker.py"
    worker.write_text(HELD_WORKER)  # rank 0 of each launch creates the trials: two processes meet at the barrier
    procs = [launch.start(*launch.torchrun(2, str(worker), str(arrived), "2", str(recipe)), threads=True)
             for _ in range(2)]
    try:
        outputs = [proc.communicate(timeout=400) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert all(proc.returncode == 0 for proc in procs), [err[-3000:] for _, err in outputs]
    assert len(list(arrived.iterdir())) == 2
    trials = optuna.load_study(study_name="recipe", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL"]
    trained = sorted(line.split(": ", 1)[-1] for _, err in outputs for line in err.splitlines()
                     if " of 2: trial" in line)
    assert [line.split(" with ")[0] for line in trained] == ["rank 0 of 2: trial 0", "rank 1 of 2: trial 0"], trained


@pytest.mark.slow
def test_under_ddp_a_trial_rank_0_prunes_stops_on_every_rank(tmp_path, tiny_llama_dir):
    """Rank 0 alone holds the Optuna trial: had it pruned alone (Trainer's own reporting), the other rank would train
    on into a collective that rank 0 never joins, and the run would hang. Every rank follows rank 0's decision, and
    trains the values rank 0 sampled."""
    space = {"training.learning_rate": {"type": "categorical", "choices": [3e-2, 1e-9, 2e-9]}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {
        "space": space, "n_trials": 3, "sampler": "grid", "pruner": "median",
        "pruner_kwargs": {"n_startup_trials": 1, "n_warmup_steps": 0}}, lora=None, max_steps=6)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = launch.start(*launch.torchrun(2, "-m", "hf_tune.search", str(recipe)), threads=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the two-process search hung")
    assert proc.returncode == 0, err[-3000:]
    study = optuna.load_study(study_name="recipe", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    states = {t.params["training.learning_rate"]: t.state for t in study.trials}
    assert len(states) == 3 and states[3e-2] == optuna.trial.TrialState.COMPLETE, states
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, states
    assert all(max(t.intermediate_values) < 6 for t in pruned)  # stopped at an evaluation before the last step
    # both ranks ran all three trials: rank 1 left each pruned trial and took the next one with rank 0
    assert sum("rank 1 of 2: trial " in line for line in err.splitlines()) == 3, err[-3000:]
    trials = {rank: [line.split(": trial ", 1)[1] for line in err.splitlines() if f"rank {rank} of 2: trial " in line]
              for rank in (0, 1)}
    assert trials[0] == trials[1], trials  # trial numbers and values: rank 1 trains what rank 0 sampled
    assert "best recipe:" in out


def _open_study_storage(url: str, barrier, errors, opener: str) -> None:
    barrier.wait()  # every process opens the new database at the same moment
    try:
        if opener == "make_storage":
            make_storage(SearchSection(space={}, storage=url), Path("."))
        else:
            open_rdb(url)
    except Exception as error:  # noqa: BLE001 - reported to the parent
        errors.put(repr(error))


@pytest.mark.parametrize("opener", ["make_storage", "open_rdb"])
def test_processes_opening_one_new_study_database_at_once_all_succeed(tmp_path, opener):
    """Optuna writes a new database's schema on first open; processes racing on it (two DDP ranks, or workers
    started together) failed with 'UNIQUE constraint failed: alembic_version'. A new SQLite file is opened under a
    file lock (make_storage); any database (a server's, where no file can be locked) is retried (open_rdb, tried
    here on SQLite without the lock)."""
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    for attempt in range(5):
        url = f"sqlite:///{tmp_path / f'study{attempt}.db'}"
        barrier = context.Barrier(4)
        workers = [context.Process(target=_open_study_storage, args=(url, barrier, errors, opener))
                   for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
        assert all(worker.exitcode == 0 for worker in workers)
        assert errors.empty(), errors.get()
        assert optuna.storages.RDBStorage(url).get_all_studies() == []


def test_a_storage_that_cannot_be_opened_is_named_without_its_password(tmp_path):
    with pytest.raises(HfTuneError, match=r"(?s)search.storage: could not open sqlite:///.*OperationalError.*fix:"):
        open_rdb(f"sqlite:///{tmp_path / 'no' / 'such' / 'folder' / 'study.db'}", attempts=2)
    assert redact_url("postgresql://optuna:s3cret@db.example:5432/studies") == \
        "postgresql://optuna:***@db.example:5432/studies"


def test_tpe_starts_sampling_by_its_model_after_the_startup_trials_the_recipe_sets():
    from hf_tune.search.sampling import make_sampler

    def params(sampler) -> list[float]:
        study = optuna.create_study(sampler=sampler)
        study.optimize(lambda t: (t.suggest_float("x", -5, 5) - 1) ** 2, n_trials=6)
        return [t.params["x"] for t in study.trials]

    space = {"x": {"type": "float", "low": -5, "high": 5}}
    tpe = params(make_sampler(SearchSection(space=space, n_trials=6, sampler_kwargs={"n_startup_trials": 2})))
    default_tpe = params(make_sampler(SearchSection(space=space, n_trials=6)))
    random = [optuna.samplers.RandomSampler(seed=42 + k).sample_independent(
        None, optuna.trial.create_trial(value=0.0), "x", optuna.distributions.FloatDistribution(-5, 5))
        for k in range(6)]
    assert tpe[:2] == random[:2] and tpe[2:] != random[2:]  # two random trials, then TPE's model
    assert default_tpe == random  # Optuna's default: the first 10 trials are random, so 6 trials are a random search


def test_the_shipped_search_recipe_lets_tpe_model_most_of_its_trials(monkeypatch):
    monkeypatch.chdir(REPO)
    spec = load_recipe(REPO / "recipes" / "llm_lora_search.yaml").search
    assert spec.sampler == "tpe" and spec.sampler_kwargs["n_startup_trials"] < spec.n_trials / 2


def test_hf_tune_search_stays_the_function_after_the_python_m_entry_point_is_imported():
    code = ("import inspect, runpy, sys; import hf_tune; sys.argv = ['x', '--help']\n"
            "try:\n    runpy.run_module('hf_tune.search', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "import hf_tune.search.__main__\n"
            "assert inspect.isfunction(hf_tune.search), hf_tune.search\nprint('function')")
    result = launch.run("python", "-c", code, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("function"), result.stderr[-2000:]


def test_a_searched_value_that_the_schedule_refuses_is_caught_when_the_recipe_loads(tmp_path, tiny_llama_dir):
    space = {"training.lr_scheduler_type": {"type": "categorical", "choices": ["linear", "cosine"]}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {"space": space, "n_trials": 2})
    raw["optim"] = {"min_lr_ratio": 0.1}  # a floor for the cosine schedule: not for a linear one
    with pytest.raises(HfTuneError, match=r"search.space.training.lr_scheduler_type: optim.min_lr_ratio"):
        load_recipe(raw)


def test_a_searched_floor_of_the_schedule_is_the_floor_each_trial_trains_with(tmp_path, tiny_llama_dir):
    """optim.min_lr_ratio is not a TrainingArguments key: each trial's schedule must still follow its value (a study
    of one trial per value, so that each trial's checkpoint stays to be read)."""
    lowest = {}
    for ratio in (0.0, 0.5):
        space = {"optim.min_lr_ratio": {"type": "categorical", "choices": [ratio]}}
        raw = search_recipe(tiny_llama_dir, tmp_path / f"study-{ratio}", {"space": space, "n_trials": 1},
                            max_steps=6, warmup_steps=0, logging_steps=1, save_strategy="steps", save_steps=6)
        search(load_recipe(raw))
        state = tmp_path / f"study-{ratio}" / "trial-0" / "checkpoint-6" / "trainer_state.json"
        rates = [entry["learning_rate"] for entry in json.loads(state.read_text())["log_history"]
                 if "learning_rate" in entry]
        lowest[ratio] = min(rates)
    peak = raw["training"]["learning_rate"]
    assert lowest[0.5] >= 0.5 * peak - 1e-12  # never below its floor
    assert lowest[0.0] < 0.5 * peak  # the trial without a floor goes below it: the trials differ


def tiny_llama_lora_params(model_dir: str, r: int, modules: list[str]) -> int:
    """LoRA parameters of the tiny Llama for these projections: r x (fan-in + fan-out) per module and layer."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    shapes = {"q_proj": (hidden, hidden), "k_proj": (hidden, config["num_key_value_heads"] * head_dim),
              "v_proj": (hidden, config["num_key_value_heads"] * head_dim), "o_proj": (hidden, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return config["num_hidden_layers"] * sum(r * (shapes[m][0] + shapes[m][1]) for m in modules)


def test_list_valued_choices_reach_the_trial_and_the_best_recipe_as_lists(tmp_path, tiny_llama_dir):
    choices = [["q_proj", "v_proj"], "all-linear", ["gate_proj", "up_proj", "down_proj"]]
    space = {"lora.target_modules": {"type": "categorical", "choices": choices}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {"space": space, "sampler": "grid", "n_trials": 3},
                        max_steps=2, eval_steps=2)
    result = search(load_recipe(raw))

    every_linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    stored = optuna.load_study(study_name="study", storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}").trials
    assert sorted(t.params["lora.target_modules"] for t in stored) == sorted(
        [json.dumps(c) if isinstance(c, list) else c for c in choices])  # Optuna keeps scalars: the lists' JSON
    for t in result["trials"]:
        encoded = t["params"]["lora.target_modules"]
        modules = every_linear if encoded == "all-linear" else json.loads(encoded)
        assert t["trainable_params"] == tiny_llama_lora_params(tiny_llama_dir, 4, modules), encoded
    best_raw = yaml.safe_load(Path(result["best_recipe"]).read_text())
    best = result["best"][0]["params"]["lora.target_modules"]
    assert best_raw["lora"]["target_modules"] == (best if best == "all-linear" else json.loads(best))
    load_recipe(result["best_recipe"])


def test_a_conditional_key_is_searched_only_when_its_condition_holds():
    """Real Optuna trials sample the space (no training): adam_beta2 only with AdamW; a condition on a key the recipe
    sets holds (model.task) or never does."""
    from hf_tune.search.sampling import sample_trial

    space = SearchSection(space={
        "training.adam_beta2": {"type": "float", "low": 0.9, "high": 0.99,
                                "when": {"training.optim": ["adamw_torch", "adamw_torch_fused"]}},
        "training.optim": {"type": "categorical", "choices": ["adamw_torch", "sgd"]},
        "optim.min_lr_ratio": {"type": "float", "low": 0.0, "high": 0.5, "when": {"model.task": "causal_lm"}},
        "training.weight_decay": {"type": "float", "low": 0.0, "high": 0.1,
                                  "when": {"model.task": "sequence_classification"}},
    }).space
    recipe = {"model": {"task": "causal_lm"}, "training": {"optim": "adamw_torch"}}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    values = []
    study.optimize(lambda trial: values.append(sample_trial(trial, space, recipe)) or 0.0, n_trials=12)

    assert {v["training.optim"] for v in values} == {"adamw_torch", "sgd"}
    for trial, v in zip(study.trials, values):
        assert ("training.adam_beta2" in v) == (v["training.optim"] == "adamw_torch")
        assert set(trial.params) == set(v)  # Optuna holds only the keys searched in that trial
        assert "optim.min_lr_ratio" in v and "training.weight_decay" not in v


@pytest.mark.parametrize("space, message", [
    ({"training.adam_beta2": {"type": "float", "low": 0.9, "high": 0.99, "when": {"training.optimm": "sgd"}}},
     "search.space.training.adam_beta2.when.training.optimm: 'training.optimm' is neither searched nor set"),
    ({"training.optim": {"type": "categorical", "choices": ["adamw_torch", "sgd"]},
      "training.adam_beta2": {"type": "float", "low": 0.9, "high": 0.99, "when": {"training.optim": "adafactor"}}},
     "none of \\['adafactor'\\] is among the choices"),
    ({"training.adam_beta1": {"type": "float", "low": 0.8, "high": 0.9, "when": {"training.adam_beta2": 0.95}},
      "training.adam_beta2": {"type": "float", "low": 0.9, "high": 0.99, "when": {"training.adam_beta1": 0.85}}},
     "conditions form a cycle"),
    ({"lora.target_modules": {"type": "categorical", "choices": [["q_proj"], '["q_proj"]']}}, "the same choice twice"),
])
def test_bad_conditional_or_list_spaces_are_refused_at_load(tmp_path, tiny_llama_dir, space, message):
    raw = search_recipe(tiny_llama_dir, tmp_path / "s", {"space": space, "sampler": "random"})
    with pytest.raises(HfTuneError, match=message):
        load_recipe(raw)


def test_gp_sampler_models_the_objective_after_its_startup_trials():
    from hf_tune.search.sampling import make_sampler

    def objective(trial):
        return (trial.suggest_float("x", -5, 5) - 1) ** 2

    spec = SearchSection(space={"x": {"type": "float", "low": -5, "high": 5}}, sampler="gp", n_trials=10,
                         sampler_kwargs={"n_startup_trials": 3})
    gp = optuna.create_study(sampler=make_sampler(spec))
    gp.optimize(objective, n_trials=10)
    random = [optuna.samplers.RandomSampler(seed=42 + k).sample_independent(
        None, optuna.trial.create_trial(value=0.0), "x", optuna.distributions.FloatDistribution(-5, 5))
        for k in range(10)]
    xs = [t.params["x"] for t in gp.trials]
    assert xs[:3] == random[:3] and xs[3:] != random[3:]
    # the GP's proposals come closer to the optimum than the seeded random ones the study would otherwise make
    assert min((x - 1) ** 2 for x in xs[3:]) < min((x - 1) ** 2 for x in random[3:])


def test_the_terminator_stops_a_stagnating_study_where_its_rule_says(tmp_path, tiny_llama_dir):
    space = {"training.learning_rate": {"type": "categorical", "choices": [3e-2, 1e-2, 1e-6, 2e-6, 3e-6, 4e-6]}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {
        "space": space, "sampler": "random", "n_trials": 6, "terminator": "stagnation",
        "terminator_kwargs": {"max_stagnation_trials": 1, "min_n_trials": 2}}, lora=None, max_steps=2, eval_steps=2)
    result = search(load_recipe(raw))
    values = [t["values"][0] for t in result["trials"]]

    def stagnant(prefix):  # trials since the best one, beyond the allowed 1
        return len(prefix) >= 2 and (len(prefix) - 1 - prefix.index(min(prefix))) > 1

    expected = next((k for k in range(1, 7) if stagnant(values[:k])), 6)
    assert len(values) == expected < 6  # with these seeds the study stagnates before its sixth trial
    assert result["terminated"] == {"by": "stagnation", "after_trials": expected}
    assert "the Terminator (stagnation) stopped the study" in format_summary(result)


@pytest.mark.slow
def test_dashboard_prints_a_command_that_serves_the_study(tmp_path, tiny_llama_dir, capsys):
    import urllib.request

    from hf_tune.commands.cli import main as cli_main

    space = {"training.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}
    raw = search_recipe(tiny_llama_dir, tmp_path / "study", {"space": space, "n_trials": 1}, lora=None, max_steps=2,
                        eval_steps=2)
    recipe = tmp_path / "dash.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    cli_main(["search", str(recipe), "--dashboard"])
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("dashboard: optuna-dashboard ") and "best recipe:" in out
    command = first.removeprefix("dashboard: ").split()
    port = free_port()
    command[command.index("--port") + 1] = str(port)
    assert command[-1] == f"sqlite:///{(tmp_path / 'study' / 'study.db').resolve()}"
    server = launch.start(*command)
    try:
        for _ in range(100):
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies", timeout=2).read().decode()
                break
            except OSError:
                import time
                time.sleep(0.3)
        else:
            pytest.fail(f"optuna-dashboard did not answer: {server.poll()}")
    finally:
        server.kill()
        server.communicate()
    assert '"study_name": "dash"' in body or '"study_name":"dash"' in body, body[:500]


@pytest.mark.slow
def test_a_trial_killed_mid_training_resumes_from_its_checkpoint_with_the_same_number_and_params(tmp_path,
                                                                                                tiny_llama_dir):
    import signal
    import time

    space = {"training.learning_rate": {"type": "float", "low": 1e-3, "high": 3e-2, "log": True},
             "lora.r": {"type": "categorical", "choices": [2, 8]}}

    def study_recipe(name: str) -> Path:
        raw = search_recipe(tiny_llama_dir, tmp_path / name, {"space": space, "n_trials": 1}, max_steps=8,
                            eval_steps=4, save_strategy="steps", save_steps=2)
        return write_recipe(tmp_path / f"{name}.yaml", raw)

    uninterrupted = search(load_recipe(study_recipe("whole")))["trials"][0]

    recipe = study_recipe("killed")
    worker = launch.start("python", "-m", "hf_tune.search", str(recipe))
    trial_dir = tmp_path / "killed" / "trial-0"
    deadline = time.time() + 300
    while not list(trial_dir.glob("checkpoint-*/hf_tune_complete.json")):
        assert worker.poll() is None and time.time() < deadline, worker.communicate()[1][-3000:]
        time.sleep(0.02)
    worker.send_signal(signal.SIGKILL)
    worker.communicate()
    storage = f"sqlite:///{tmp_path / 'killed' / 'study.db'}"
    [left] = optuna.load_study(study_name="killed", storage=storage).trials
    assert left.state == optuna.trial.TrialState.RUNNING  # killed mid-trial, not after it
    checkpoints = {p.parent.name for p in trial_dir.glob("checkpoint-*/hf_tune_complete.json")}
    last = max(checkpoints, key=lambda name: int(name.split("-")[1]))
    assert last != "checkpoint-8"
    written = {p: p.stat().st_mtime_ns for name in checkpoints for p in (trial_dir / name).glob("*.safetensors")}

    result = search(load_recipe(recipe))  # the same command again
    [trial] = optuna.load_study(study_name="killed", storage=storage).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.number == 0
    assert trial.params == left.params == uninterrupted["params"]
    assert trial.user_attrs["resumed_from"] == last  # trained on from there, not from step 0:
    assert all(p.stat().st_mtime_ns == stamp for p, stamp in written.items())  # the steps before it were not redone
    assert (trial_dir / "checkpoint-8" / "hf_tune_complete.json").is_file()
    assert trial.value == pytest.approx(uninterrupted["values"][0], abs=1e-6)
    assert [t["number"] for t in result["trials"]] == [0]
