"""Recipe loading: every bad input names its key and the fix; overrides; every shipped recipe validates."""

from __future__ import annotations

import copy
import sys

import launch
import pytest
import yaml
from conftest import DATA, REPO, write_recipe

from hf_tune import load_recipe
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.recipe import apply_overrides, redact_secrets

GOOD = {
    "model": {"pretrained_model_name_or_path": "embedded:SmolLM2-135M-Instruct"},
    "lora": {"r": 8, "target_modules": "all-linear"},
    "data": {"format": "chat", "train": {"path": str(DATA / "chat_demo.jsonl")}, "eval_split": 0.1},
    "training": {"output_dir": "runs/x", "learning_rate": 1e-4, "eval_strategy": "steps", "eval_steps": 5},
}


def with_(overrides: list[str]) -> dict:
    return apply_overrides(copy.deepcopy(GOOD), overrides)


def error_of(raw: dict) -> str:
    with pytest.raises(HfTuneError) as info:
        load_recipe(raw)
    return str(info.value)


def test_good_recipe_loads_with_upstream_types():
    recipe = load_recipe(GOOD, ["training.learning_rate=2e-5", "training.warmup_steps=0.1"])
    assert recipe.training["learning_rate"] == pytest.approx(2e-5)  # "2e-5" is a string to PyYAML; converted
    assert recipe.training["warmup_steps"] == 0.1
    assert recipe.lora == {"r": 8, "target_modules": "all-linear"}
    assert recipe.data.max_length == 1024


@pytest.mark.parametrize("override, key, suggestion", [
    ("trainin.learning_rate=1", "trainin", "training"),
    ("model.pretrained_model_name_or_pth=x", "model.pretrained_model_name_or_pth", "pretrained_model_name_or_path"),
    ("data.max_lenght=10", "data.max_lenght", "max_length"),
    ("data.train.pth=x.jsonl", "data.train.pth", "path"),
    ("training.learnin_rate=1e-4", "training.learnin_rate", "learning_rate"),
    ("training.eval_strategyy=steps", "training.eval_strategyy", "eval_strategy"),
    ("lora.lora_alpah=16", "lora.lora_alpah", "lora_alpha"),
])
def test_unknown_key_is_named_with_closest_valid_key(override, key, suggestion):
    message = error_of(with_([override]))
    assert f"{key}:" in message and "unknown" in message
    assert f"did you mean '{suggestion}'" in message


@pytest.mark.parametrize("override, key", [
    ("training.learning_rate=abc", "training.learning_rate"),
    ("training.num_train_epochs=[1, 2]", "training.num_train_epochs"),
    ("data.max_length=long", "data.max_length"),
    ("model.trust_remote_code=maybe", "model.trust_remote_code"),
    ("lora.r=eight", "lora.r"),
    ("data.format=tsv", "data.format"),
])
def test_wrong_type_names_the_key(override, key):
    assert error_of(with_([override])).startswith(f"{key}:")


@pytest.mark.parametrize("override, key", [
    ("training.learning_rate=-1e-4", "training.learning_rate"),
    ("training.per_device_train_batch_size=0", "training.per_device_train_batch_size"),
    ("training.weight_decay=-0.1", "training.weight_decay"),
    ("data.max_length=0", "data.max_length"),
    ("data.max_length=-5", "data.max_length"),
    ("data.eval_split=1.5", "data.eval_split"),
])
def test_bad_value_names_the_key(override, key):
    assert error_of(with_([override])).startswith(f"{key}:")


@pytest.mark.parametrize("override, key", [
    ("data.train.path=missing/train.jsonl", "data.train.path"),
    ("data.chat_template=templates/missing.jinja", "data.chat_template"),
    ("model.pretrained_model_name_or_path=./no/such/model", "model.pretrained_model_name_or_path"),
    ("model.pretrained_model_name_or_path=embedded:NoSuchModel", "model.pretrained_model_name_or_path"),
])
def test_missing_file_names_the_key(override, key):
    message = error_of(with_([override]))
    assert message.startswith(f"{key}:") and "fix:" in message


def test_upstream_training_arguments_error_is_reraised_with_the_recipe_key():
    message = error_of(with_(["training.save_strategy=steps", "training.save_steps=2.5"]))
    assert message.startswith("training.save_steps:") and "TrainingArguments" in message
    # load_best_model_at_end's own conditions are checked first, naming the key to change
    message = error_of(with_(["training.load_best_model_at_end=true", "training.save_strategy=epoch"]))
    assert message.startswith("training.save_strategy: is 'epoch' and training.eval_strategy is 'steps'")
    assert error_of(with_(["training.eval_strategy=stepz"])).startswith("training.eval_strategy:")


def test_contradictions_are_caught_at_load():
    assert error_of(with_(["data.eval_split=null"])).startswith("training.eval_strategy:")  # eval without eval data
    message = error_of(with_([f"data.eval.path={DATA / 'chat_demo.jsonl'}"]))
    assert "data.eval" in message and "not both" in message
    assert error_of(with_(["lora.task_type=SEQ_CLS"])).startswith("lora.task_type:")


def test_overrides_are_typed_yaml_and_create_nested_keys():
    raw = apply_overrides({"training": {"seed": 1}}, ["training.seed=7", "training.report_to=[wandb, tensorboard]",
                                                     "training.bf16=false", "data.train.path=x.jsonl",
                                                     "training.eval_strategy=no", "training.learning_rate=1e-4"])
    assert raw == {"training": {"seed": 7, "report_to": ["wandb", "tensorboard"], "bf16": False, "eval_strategy": "no",
                                "learning_rate": 1e-4},  # YAML 1.2 scalars: 'no' is a string, 1e-4 a float
                   "data": {"train": {"path": "x.jsonl"}}}
    for bad in ("training", "training.seed", "=3", "training..seed=1"):
        with pytest.raises(HfTuneError, match="section.key=value"):
            apply_overrides({}, [bad])


def test_a_secret_in_a_recipe_is_refused_with_the_environment_as_the_fix():
    token = "hf_abcdefSECRET" + "0123456789" * 2  # a real token's shape: hf_ and 34 characters
    cases = {f"training.hub_token={token}": "training.hub_token",
             f"training.run_name={token}": "training.run_name",
             "tracking.tags=[demo, sk-abcdefSECRET1234567890]": "tracking.tags[1]"}
    for override, key in cases.items():
        with pytest.raises(RecipeError) as info:
            load_recipe(GOOD, [override])
        assert info.value.key == key and "HF_TOKEN" in info.value.fix and "SECRET" not in str(info.value)


def test_a_mistyped_key_with_token_in_its_name_is_reported_as_the_typo_it_is():
    with pytest.raises(RecipeError) as info:
        load_recipe(GOOD, ["data.batch_token=1024"])  # data.batch_tokens, one letter short
    assert info.value.key == "data.batch_token" and info.value.problem == "unknown key"
    assert "batch_tokens" in info.value.fix and "secret" not in str(info.value)
    with pytest.raises(RecipeError) as info:  # a secret-named key of the right section is still a secret
        load_recipe(GOOD, ["training.hub_token=my-password"])
    assert info.value.key == "training.hub_token" and "my-password" not in str(info.value)


def test_a_bare_path_is_a_source_as_trl_and_llamafactory_users_write_one():
    chats, persona = DATA / "chat_demo.jsonl", DATA / "persona_demo.jsonl"
    one = load_recipe(GOOD, [f"data.train={chats}"])
    assert one.data.train.path == str(chats) and one.data.train.split == "train"
    mixed = load_recipe(GOOD, [f"data.train=[{chats}, {persona}]", f"data.eval={persona}", "data.eval_split=null"])
    assert [source.path for source in mixed.data.train] == [str(chats), str(persona)]
    assert mixed.data.eval.path == str(persona)


def test_names_that_only_look_like_tokens_or_secret_keys_are_not_refused():
    recipe = load_recipe(GOOD, ["training.output_dir=runs/hf_finetuning", "data.train.path=" + str(DATA / "chat_demo.jsonl"),
                                "lora.rank_pattern={key: 16}"])  # BERT's attention has a module named "key"
    assert recipe.training["output_dir"] == "runs/hf_finetuning" and recipe.lora["rank_pattern"] == {"key": 16}


def test_redaction_masks_secret_keys_and_token_shaped_values():
    resolved = redact_secrets({"training": {"hub_token": "anything", "learning_rate": 1e-4},
                               "notes": ["pushed with hf_abcdefSECRET0123456789abcdefghij"]})
    assert resolved["training"] == {"hub_token": "***", "learning_rate": 1e-4}
    assert "SECRET" not in yaml.safe_dump(resolved)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO / "examples" / "agent"))  # llm_agent's environment module
    recipe = load_recipe(path)
    assert recipe.source == path and recipe.training["output_dir"]


def test_cli_validate_prints_resolved_recipe_and_bad_recipe_exits_nonzero_without_traceback(tmp_path, capsys):
    """The two console entry points run as processes (exit status, stderr); the printing and --debug in-process."""
    from hf_tune.commands.cli import main

    main(["validate", str(REPO / "recipes" / "llm_lora.yaml"), "training.max_steps=3"])
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["training"]["max_steps"] == 3 and resolved["model"]["task"] == "causal_lm"

    bad = write_recipe(tmp_path / "bad.yaml", with_(["training.learnin_rate=1e-4"]))
    result = launch.run("hf-tune", "validate", str(bad))
    assert result.returncode == 2
    assert "training.learnin_rate" in result.stderr and "learning_rate" in result.stderr
    assert "Traceback" not in result.stderr

    result = launch.run("python", "-m", "hf_tune.run", str(bad))  # the training entry point fails the same way
    assert result.returncode == 2 and "training.learnin_rate" in result.stderr and "Traceback" not in result.stderr

    with pytest.raises(RecipeError, match="training.learnin_rate"):  # --debug before the verb: raised, so a traceback
        main(["--debug", "validate", str(bad)])


def test_debug_after_the_verb_shows_the_traceback_too(tmp_path, capsys):
    from hf_tune.commands.cli import main
    from hf_tune.errors import RecipeError

    bad = write_recipe(tmp_path / "bad.yaml", with_(["training.learnin_rate=1e-4"]))
    with pytest.raises(RecipeError):  # raised, not printed: the traceback is shown
        main(["validate", str(bad), "--debug"])
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(bad)])
    assert exit_info.value.code == 2 and "training.learnin_rate" in capsys.readouterr().err


def test_offline_hub_id_is_refused_at_load_with_how_to_use_a_local_copy(monkeypatch):
    from hf_tune.workflows import hub

    monkeypatch.setattr(hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # the network boundary: nothing listens
    hub.hub_is_reachable.cache_clear()
    try:
        message = error_of(with_(["model.pretrained_model_name_or_path=some-org/never-downloaded"]))
    finally:
        hub.hub_is_reachable.cache_clear()
    assert message.startswith("model.pretrained_model_name_or_path:") and "local folder" in message


def test_missing_recipe_file_and_non_mapping(tmp_path):
    with pytest.raises(HfTuneError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(HfTuneError, match="mapping"):
        load_recipe(path)


@pytest.mark.parametrize("override, package, key", [("training.report_to=[wandb]", "wandb", "training.report_to"),
                                                     ("training.deepspeed=zero2", "deepspeed", "training.deepspeed")])
def test_an_integration_that_is_not_installed_is_refused_with_its_extra(override, package, key, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # what an install without the extra looks like to find_spec
    with pytest.raises(RecipeError) as info:
        load_recipe(GOOD, [override])
    assert info.value.key == key and f"hf_tune[{package}]" in info.value.fix


def test_top_level_keys_method_and_rewards_take_overrides():
    recipe = load_recipe(REPO / "recipes/llm_dpo.yaml", ["method=kto"])
    assert recipe.method == "kto"
    grpo = load_recipe(REPO / "recipes/llm_grpo.yaml", ["rewards.0.weight=2.5"])
    assert grpo.rewards[0] == {"name": "exact_answer", "column": "answer", "weight": 2.5}
    grpo = load_recipe(REPO / "recipes/llm_grpo.yaml", ["rewards=[{name: format_regex, pattern: 'x'}]"])
    assert grpo.rewards == [{"name": "format_regex", "pattern": "x"}]
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / "recipes/llm_grpo.yaml", ["rewards.5.weight=2"])
    assert info.value.key == "rewards.5.weight" and "0 to 1" in info.value.fix
    with pytest.raises(RecipeError) as info:
        load_recipe(REPO / "recipes/llm_dpo.yaml", ["method=dpoo"])
    assert info.value.key == "method"
    for bad in ("learning_rate=1e-4", "model=x"):
        with pytest.raises(HfTuneError, match="section.key=value"):
            apply_overrides({}, [bad])


@pytest.mark.parametrize("name", ["activation_checkpointing", "gradient_checkpointing"])
def test_a_quantized_base_is_checkpointed_with_the_recipes_kwargs_by_either_name(name, tiny_llama_dir, tmp_path):
    """transformers 5.24 renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs): the QLoRA
    preparation honours the new names and still reads the old ones."""
    from conftest import chat_recipe

    from hf_tune.assembly.run_build import build_model_and_tokenizer

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", **{name: True, f"{name}_kwargs": {"use_reentrant": True}})
    raw["model"]["quantization_config"] = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    raw["lora"] = {"r": 4, "target_modules": ["q_proj"]}
    model, _ = build_model_and_tokenizer(load_recipe(raw))
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    assert layers  # every decoder layer recomputes its activations, with the recipe's torch checkpoint arguments
    assert all(m._gradient_checkpointing_func.keywords == {"use_reentrant": True} for m in layers)


def test_validate_shows_the_values_hf_tune_decides_marked_as_its_defaults(tiny_llama_dir, tmp_path, capsys):
    """`hf-tune validate` prints what the run will use: hf_tune's own defaults in place, each marked, and the output
    is itself a recipe that loads."""
    import torch
    from conftest import chat_recipe

    from hf_tune.commands.cli import main as cli_main

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", learning_rate=2e-4)
    del raw["training"]["per_device_train_batch_size"]
    raw["data"]["batch_tokens"] = 256
    cli_main(["validate", str(write_recipe(tmp_path / "r.yaml", raw))])
    shown = capsys.readouterr().out
    marked = {line.split(":")[0].strip() for line in shown.splitlines() if line.endswith("# hf_tune's default")}
    assert {"attn_implementation", "padding_free", "resume_from_checkpoint", "per_device_train_batch_size",
            "enable_jit_checkpoint"} <= marked
    assert "learning_rate" not in marked and "output_dir" not in marked  # the recipe's own keys are not marked
    effective = yaml.safe_load(shown)
    assert effective["training"]["resume_from_checkpoint"] == "auto"
    assert effective["training"]["enable_jit_checkpoint"] is True  # save on SIGTERM / SIGUSR1 (docs/runs.md)
    assert effective["training"]["per_device_train_batch_size"] == 1  # one pack of data.batch_tokens per step
    assert effective["model"]["attn_implementation"] == "sdpa_varlen" and effective["data"]["padding_free"] is True
    if not torch.cuda.is_available():
        assert "use_cpu" in marked and effective["training"]["use_cpu"] is True
    assert load_recipe(effective).training["resume_from_checkpoint"] == "auto"  # what it shows is a recipe

    raw["model"]["attn_implementation"] = "eager"  # the recipe's choice: shown unmarked, and packs stay padded
    raw["training"]["resume_from_checkpoint"] = "auto"  # the recipe's own, though equal to the default: unmarked
    cli_main(["validate", str(write_recipe(tmp_path / "r.yaml", raw))])
    shown = capsys.readouterr().out
    assert "  attn_implementation: eager\n" in shown and "  padding_free: false  # hf_tune's default" in shown
    assert "  resume_from_checkpoint: auto\n" in shown


def test_the_readme_example_recipe_is_the_shipped_one_abridged():
    """Every key the README's example sets has the shipped recipe's value (the README drifted from it before)."""
    text = (REPO / "README.md").read_text()
    block = text.split("# recipes/llm_lora.yaml, abridged\n", 1)[1].split("```", 1)[0]
    example, shipped = yaml.safe_load(block), yaml.safe_load((REPO / "recipes" / "llm_lora.yaml").read_text())
    pairs = [(f"{section}.{key}", value, shipped[section].get(key, "missing"))
             for section, keys in example.items() for key, value in keys.items()]
    assert len(pairs) > 15 and [p for p in pairs if p[1] != p[2]] == []
