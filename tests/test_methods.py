"""Methods beyond SFT on TRL's trainers (dpo, kto, reward, grpo): the recipe key, the data layouts, hf_tune's
features over TRL's classes, and each loss against one written here from log-probabilities or scores."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import launch
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import DATA, REPO, nan_model
from inputs import PAIRS, conversational_pairs, method_recipe, write_jsonl

from hf_tune import load_recipe, train
from hf_tune.assembly.run_build import build_run
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.recipe import read_recipe


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# --- the recipe ---------------------------------------------------------------------------------------------------

def test_an_unknown_method_suggests_the_closest(tmp_path, tiny_llama_dir):
    raw = method_recipe("dpoo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run")
    with pytest.raises(RecipeError, match=r"method: unknown method 'dpoo'.*\n.*did you mean 'dpo'"):
        read_recipe(raw)


def test_training_is_checked_against_the_methods_trl_config(tmp_path, tiny_llama_dir):
    data = conversational_pairs(tmp_path / "p.jsonl")
    recipe = read_recipe(method_recipe("dpo", tiny_llama_dir, data, tmp_path / "run", beta=0.3, loss_type=["ipo"]))
    assert recipe.training["beta"] == 0.3 and recipe.method == "dpo"
    with pytest.raises(RecipeError, match=r"training.betta: unknown key: not an argument of DPOConfig.*\n.*'beta'"):
        read_recipe(method_recipe("dpo", tiny_llama_dir, data, tmp_path / "run", betta=0.3))
    sft = {"model": {"pretrained_model_name_or_path": tiny_llama_dir}, "data": {"train": {"path": str(data)}},
           "training": {"beta": 0.1}}
    with pytest.raises(RecipeError, match=r"training.beta: unknown key: not an argument of TrainingArguments"):
        read_recipe(sft)


def test_the_method_sets_the_model_head_and_data_format_and_refuses_others(tmp_path, tiny_llama_dir):
    data = conversational_pairs(tmp_path / "p.jsonl")
    recipe = read_recipe(method_recipe("reward", tiny_llama_dir, data, tmp_path / "run"))
    assert (recipe.model.task, recipe.data.format) == ("reward_model", "preference")
    raw = method_recipe("reward", tiny_llama_dir, data, tmp_path / "run")
    raw["model"]["task"] = "causal_lm"
    with pytest.raises(RecipeError, match=r"model.task: is 'causal_lm', but method 'reward' trains a reward_model"):
        read_recipe(raw)
    raw = method_recipe("dpo", tiny_llama_dir, data, tmp_path / "run")
    raw["data"]["format"] = "chat"
    with pytest.raises(RecipeError, match=r"data.format: 'chat' is not read by method 'dpo'"):
        read_recipe(raw)
    raw = method_recipe("dpo", tiny_llama_dir, data, tmp_path / "run")
    raw["data"]["max_length"] = 256
    with pytest.raises(RecipeError, match=r"data.max_length: applies to method 'sft'.*\n.*training.max_length"):
        read_recipe(raw)


def test_grpo_rewards_are_checked_when_the_recipe_loads(tmp_path, tiny_llama_dir):
    prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}])
    raw = method_recipe("grpo", tiny_llama_dir, prompts, tmp_path / "run")
    with pytest.raises(RecipeError, match=r"rewards: method 'grpo' needs at least one reward function"):
        read_recipe(raw)
    for rewards, message in ((["exact_anser"], r"rewards\[0\]: unknown reward 'exact_anser'.*\n.*'exact_answer'"),
                             ([{"name": "format_regex"}], r"rewards\[0\]: reward 'format_regex' needs \['pattern'\]"),
                             ([{"name": "format_regex", "pattern": "(("}], r"rewards\[0\].pattern: not a regular expression")):
        with pytest.raises(RecipeError, match=message):
            read_recipe({**raw, "rewards": rewards})
    dpo = method_recipe("dpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run")
    with pytest.raises(RecipeError, match=r"rewards: only methods grpo and rloo use reward functions"):
        read_recipe({**dpo, "rewards": ["exact_answer"]})


# --- the data -----------------------------------------------------------------------------------------------------

def load_pairs(path: Path, method: str = "dpo"):
    from hf_tune.data.preference import load_method_data

    recipe = read_recipe({"method": method, "model": {"pretrained_model_name_or_path": "org/model"},
                          "data": {"train": {"path": str(path)}}, "training": {"output_dir": "unused"}})
    return load_method_data(recipe.data, method, 0)[0]


def test_every_preference_layout_reads_as_the_same_pairs(tmp_path):
    expected = [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": c}],
                 "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS]
    layouts = {
        "explicit.jsonl": expected,
        "implicit.jsonl": [{"chosen": e["prompt"] + e["chosen"], "rejected": e["prompt"] + e["rejected"]}
                           for e in expected],
        "factory_sharegpt.json": [{"conversations": [{"from": "human", "value": p}], "chosen": {"from": "gpt", "value": c},
                                   "rejected": {"from": "gpt", "value": r}} for p, c, r in PAIRS],
        "factory_alpaca.json": [{"instruction": p, "chosen": c, "rejected": r} for p, c, r in PAIRS],
        "text_parts.jsonl": [{key: [{**m, "content": [{"type": "text", "text": m["content"][:3]},  # OpenAI's parts
                                                      {"type": "text", "value": m["content"][3:]}]}  # LLaMA-Factory's
                                    for m in e[key]] for key in e} for e in expected],
    }
    for name, rows in layouts.items():
        path = tmp_path / name
        if name.endswith(".json"):
            path.write_text(json.dumps(rows))
        else:
            write_jsonl(path, rows)
        assert load_pairs(path).to_list() == expected, name
    strings = write_jsonl(tmp_path / "strings.jsonl", [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS])
    assert load_pairs(strings)[0] == {"prompt": PAIRS[0][0], "chosen": PAIRS[0][1], "rejected": PAIRS[0][2]}


def test_shipped_llamafactory_pairs_read_like_the_shipped_trl_pairs():
    factory = load_pairs(DATA / "preference_llamafactory_demo.json")
    trl_layout = load_pairs(DATA / "preference_demo.jsonl").select(range(len(factory)))
    assert factory.to_list() == trl_layout.to_list()


@pytest.mark.parametrize("row, message", [
    ({"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": [
        {"type": "reasoning", "value": "hm"}, {"type": "text", "value": "Hello"}]}],
      "rejected": [{"role": "assistant", "content": "Bye"}]},
     r"column 'chosen': message 1: a reasoning part: chosen messages take text parts only"),
    ({"prompt": "Hi", "chosen": "Hello"}, r"format 'preference' needs columns \['chosen', 'rejected'\]; missing \['rejected'\]"),
    ({"prompt": "Hi", "chosen": " ", "rejected": "Go away"}, r"line 2 \(example 2 of 2\), column 'chosen': the answer is empty"),
    ({"prompt": "Hi", "chosen": "Hello", "rejected": "Hello"}, r"line 2 \(example 2 of 2\), column 'rejected': equals 'chosen'"),
    ({"prompt": "Hi", "chosen": [{"role": "assistant"}], "rejected": "No"}, r"column 'chosen': message 1 has keys \['role'\]"),
])
def test_bad_pairs_are_named_by_file_line_and_column(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Ok", "chosen": "Yes", "rejected": "No"}, row]
                       if "rejected" in row else [row])
    with pytest.raises(RecipeError, match=message):
        load_pairs(path)


def test_kto_reads_unpaired_rows_and_unpairs_a_preference_set(tmp_path):
    unpaired = write_jsonl(tmp_path / "u.jsonl", [{"prompt": "Hi", "completion": "Hello", "label": True},
                                                   {"prompt": "Hi", "completion": "Go away", "label": False}])
    recipe = {"method": "kto", "model": {"pretrained_model_name_or_path": "org/model"},
              "data": {"train": {"path": str(unpaired)}}, "training": {"output_dir": "unused"}}
    assert read_recipe(recipe).data.format == "unpaired_preference"
    assert load_pairs(unpaired, "kto")["label"] == [True, False]
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "Hi", "completion": "Hello", "label": "yes"}])
    with pytest.raises(RecipeError, match=r"column 'label': expected true \(desirable\) or false, got 'yes'"):
        load_pairs(bad, "kto")
    recipe["data"] = {"format": "preference", "train": {"path": str(conversational_pairs(tmp_path / "p.jsonl"))}}
    rows = load_method_data_of(recipe)
    assert len(rows) == 2 * len(PAIRS) and sorted(set(rows["label"])) == [False, True]


def load_method_data_of(raw: dict):
    from hf_tune.data.preference import load_method_data

    recipe = read_recipe(raw)
    return load_method_data(recipe.data, recipe.method, 0)[0]


# --- DPO ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def dpo_run(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    raw = method_recipe("dpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        beta=0.5, learning_rate=1e-6)
    return build_run(load_recipe(raw)), raw


def sequence_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the log-probabilities of the completion tokens of each sequence: (chosen, rejected), written here."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    token_logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    sums = (token_logps * batch["completion_mask"][:, 1:]).sum(dim=1)
    return sums.chunk(2)


def test_dpo_reference_is_the_base_with_the_adapter_disabled(dpo_run):
    from peft import PeftModel

    run, _ = dpo_run
    trainer = run.trainer
    assert isinstance(trainer.model, PeftModel) and trainer.ref_model is None  # no second copy of the model
    assert list(trainer.model.peft_config) == ["default"]  # and no copy of the adapter
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(trainer.train_dataset.column_names)


def test_dpo_loss_is_ln2_at_step_0_and_equals_the_loss_written_from_log_probabilities(dpo_run):
    run, _ = dpo_run
    trainer, model = run.trainer, run.trainer.model
    trainer.train()
    assert logged(trainer, "loss")[0] == pytest.approx(math.log(2), abs=1e-6)  # the policy is the reference
    assert logged(trainer, "rewards/chosen")[0] == 0 and logged(trainer, "rewards/margins")[0] == 0

    with torch.no_grad():  # move the adapter away from the reference, then compare one batch's loss
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    batch = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        policy_chosen, policy_rejected = sequence_logps(model, batch)
        with model.disable_adapter():
            ref_chosen, ref_rejected = sequence_logps(model, batch)
        beta = trainer.args.beta
        expected = -F.logsigmoid(beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))).mean()
        got = trainer.compute_loss(model, batch)
    assert torch.allclose(batch["ref_chosen_logps"], ref_chosen, atol=1e-5)  # the precomputed reference
    assert got.item() == pytest.approx(expected.item(), abs=1e-5)


def test_dpo_with_trls_activation_checkpointing_has_the_gradient_of_the_loss_written_here(tmp_path, tiny_llama_dir,
                                                                                           monkeypatch):
    """hf_tune keeps TRL's activation checkpointing for dpo (training_args.py): the recompute must leave a step's
    gradient as it is. One batch's adapter gradient, with and without it, against the gradient of the DPO loss written
    here from log-probabilities; the tolerance is how far the run without checkpointing is from the written one (TRL's
    fused head against a full log_softmax), so checkpointing may add no error of its own."""
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    pairs = conversational_pairs(tmp_path / "p.jsonl")
    gradients, written, batch, adapter = {}, None, None, None
    for checkpointing in (False, True):
        raw = method_recipe("dpo", tiny_llama_dir, pairs, tmp_path / f"run-{checkpointing}", beta=0.5)
        del raw["training"]["gradient_checkpointing"]
        if not checkpointing:
            raw["training"]["activation_checkpointing"] = False
        trainer = build_run(load_recipe(raw)).trainer
        model = trainer.model
        assert trainer.args.activation_checkpointing is checkpointing
        if checkpointing:  # what Trainer.train does first with these arguments
            model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=trainer.args.activation_checkpointing_kwargs)
        assert model.get_base_model().is_activation_checkpointing is checkpointing
        if adapter is None:  # the first run draws the adapter and the batch; the second takes the same
            torch.manual_seed(0)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0, 0.05)
            adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            batch = next(iter(trainer.get_train_dataloader()))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.requires_grad:
                    param.copy_(adapter[name])
        model.train()
        trainer.compute_loss(model, batch).backward()
        gradients[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        if not checkpointing:  # the loss written from log-probabilities, on the model without checkpointing
            model.zero_grad()
            with torch.no_grad(), model.disable_adapter():
                ref_chosen, ref_rejected = sequence_logps(model, batch)
            chosen, rejected = sequence_logps(model, batch)
            beta = trainer.args.beta
            (-F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()).backward()
            written = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    def distance(grads: dict) -> float:
        return max((grads[n] - written[n]).abs().max().item() for n in written)

    scale = max(g.abs().max().item() for g in written.values())
    assert scale > 1e-4  # the adapter is away from the reference: the gradient is not zero
    floor = distance(gradients[False])
    assert floor < 1e-3 * scale  # the two computations of the same loss agree
    assert distance(gradients[True]) <= 2 * floor + 1e-7 * scale


def test_dpo_optimizer_has_hf_tunes_groups_with_the_lr_of_their_depth(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    raw = method_recipe("dpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        learning_rate=1e-3, weight_decay=0.1)
    raw["optim"] = {"layerwise_lr_decay": 0.5}
    trainer = build_run(load_recipe(raw)).trainer
    optimizer = trainer.create_optimizer()
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(lr_of) == len(trained)  # every trained parameter in exactly one group
    for name, param in trained:  # 2 blocks: block i is at depth i + 1, its LR 1e-3 * 0.5 ** (3 - depth)
        block = int(name.split(".layers.")[1].split(".")[0])
        assert lr_of[id(param)] == pytest.approx(1e-3 * 0.5 ** (2 - block))


def test_dpo_nan_guard_stops_before_the_step(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    broken = nan_model(tiny_llama_dir, tmp_path / "nan-model")
    raw = method_recipe("dpo", broken, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run")
    raw["training"]["precompute_ref_log_probs"] = False  # else the reference pass meets the NaN first
    with pytest.raises(HfTuneError, match=r"(?s)loss at step 1 is nan.*last good checkpoint: none yet"):
        train(load_recipe(raw))


def test_reference_log_probabilities_are_reused_across_runs_and_adapters(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    data = conversational_pairs(tmp_path / "p.jsonl")
    first = build_run(load_recipe(method_recipe("dpo", tiny_llama_dir, data, tmp_path / "a"))).trainer
    assert getattr(first, "reference_cache_hits", 0) == 0
    other = method_recipe("dpo", tiny_llama_dir, data, tmp_path / "b", seed=7)
    other["lora"]["r"] = 8  # another adapter on the same base: the same reference
    second = build_run(load_recipe(other)).trainer
    assert second.reference_cache_hits == 1
    assert second.train_dataset["ref_chosen_logps"] == first.train_dataset["ref_chosen_logps"]
    truncated = method_recipe("dpo", tiny_llama_dir, data, tmp_path / "c", max_length=30, truncation_mode="keep_end")
    assert getattr(build_run(load_recipe(truncated)).trainer, "reference_cache_hits", 0) == 0  # other tokens
    too_short = method_recipe("dpo", tiny_llama_dir, data, tmp_path / "d", max_length=8)
    with pytest.raises(RecipeError, match=r"training.max_length: every prompt of the train data fills it"):
        build_run(load_recipe(too_short))


@pytest.mark.slow
def test_dpo_killed_between_checkpoints_resumes_to_the_same_adapter_and_losses(tmp_path, tiny_llama_dir):
    from runs import kill_after_checkpoint, run_to_end, step_losses
    from safetensors.torch import load_file

    data = conversational_pairs(tmp_path / "p.jsonl")

    def recipe_file(name: str) -> Path:
        raw = method_recipe("dpo", tiny_llama_dir, data, tmp_path / name, max_steps=8, save_strategy="steps",
                            save_steps=4, learning_rate=5e-3, seed=3)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    reference = run_to_end(recipe_file("reference"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = recipe_file("killed")
    kill_after_checkpoint(killed, tmp_path / "killed", 4)
    resumed = run_to_end(killed)
    assert resumed.returncode == 0 and "Resuming from" in resumed.stderr, resumed.stderr[-3000:]
    assert step_losses(tmp_path / "killed") == step_losses(tmp_path / "reference")
    mine = load_file(tmp_path / "killed" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "reference" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


# --- reward model, KTO, GRPO --------------------------------------------------------------------------------------

def test_reward_model_loss_is_the_pairwise_loss_of_its_scores(tmp_path, tiny_llama_dir):
    raw = method_recipe("reward", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run")
    trainer = build_run(load_recipe(raw)).trainer
    model = trainer.model
    assert model.get_base_model().config.num_labels == 1
    batch = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        chosen, rejected = scores.chunk(2)
        expected = -F.logsigmoid(chosen - rejected).mean()
        got = trainer.compute_loss(model, batch)
    assert got.item() == pytest.approx(expected.item(), abs=1e-6)


def test_kto_loss_at_step_0_is_the_closed_form(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    rows = [{"prompt": p, "completion": c, "label": True} for p, c, _ in PAIRS] + \
           [{"prompt": p, "completion": r, "label": False} for p, _, r in PAIRS]
    data = write_jsonl(tmp_path / "u.jsonl", rows)
    raw = method_recipe("kto", tiny_llama_dir, data, tmp_path / "run", per_device_train_batch_size=4, max_steps=1,
                        learning_rate=1e-6, desirable_weight=1.0, undesirable_weight=1.0)
    run = build_run(load_recipe(raw))
    run.trainer.train()
    # policy == reference: every log-ratio and the KL estimate are 0, so each example's loss is 1 - sigmoid(0)
    assert logged(run.trainer, "loss")[0] == pytest.approx(1 - 1 / (1 + math.exp(0)), abs=1e-6)


def test_grpo_scores_its_sampled_completions_with_the_recipes_reward_functions(tmp_path, tiny_llama_dir):
    module = tmp_path / "my_rewards.py"
    module.write_text("SEEN = []\n\ndef length_reward(prompts, completions, **columns):\n"
                      "    scores = [float(len(c[-1]['content'] if isinstance(c, list) else c) % 3) for c in completions]\n"
                      "    SEEN.append(scores)\n    return scores\n")
    sys.path.insert(0, str(tmp_path))
    try:
        prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}],
                                                      "answer": str(a + 1)} for a in range(8)])
        raw = method_recipe("grpo", tiny_llama_dir, prompts, tmp_path / "run", per_device_train_batch_size=4,
                            num_generations=2, max_completion_length=4, max_steps=2, beta=0.0)
        raw["rewards"] = ["my_rewards:length_reward", {"name": "exact_answer", "column": "answer"}]
        run = build_run(load_recipe(raw))
        run.trainer.train()
        import my_rewards

        assert len(my_rewards.SEEN) == 2 and all(len(s) == 4 for s in my_rewards.SEEN)
        means = logged(run.trainer, "rewards/length_reward/mean")
        assert means == pytest.approx([sum(s) / len(s) for s in my_rewards.SEEN], abs=1e-6)
        assert logged(run.trainer, "rewards/exact_answer/mean")  # the shipped reward ran beside it
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_rewards", None)


def test_shipped_rewards_read_answers_like_a_person_would():
    from hf_tune.catalog.rewards import exact_answer, format_regex

    completions = ["The answer is 12.", [{"role": "assistant", "content": "1,200"}], "12.50", "no idea"]
    assert exact_answer(None, completions, answer=["12", "1200", "12.5", "3"]) == [1.0, 1.0, 1.0, 0.0]
    assert format_regex(None, ["42", " 42 ", "42 apples"], pattern=r"-?\d+") == [1.0, 1.0, 0.0]


def test_every_shipped_method_recipe_validates(monkeypatch):
    monkeypatch.chdir(REPO)  # the recipes name their data files relative to the repository
    expected = {"llm_dpo": ("dpo", "causal_lm"), "reward_model": ("reward", "reward_model"),
                "llm_grpo": ("grpo", "causal_lm"), "llm_rloo": ("rloo", "causal_lm"),
                "llm_orpo": ("orpo", "causal_lm"), "llm_simpo": ("simpo", "causal_lm"),
                "llm_distillation": ("distillation", "causal_lm")}  # a reward model's task follows its method
    for name, (method, task) in expected.items():
        recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")  # read, then preflight
        assert (recipe.method, recipe.model.task) == (method, task), name


def test_plan_shows_the_method_and_counts_its_batches(tmp_path, tiny_llama_dir):
    from hf_tune.commands.plan import format_plan
    from hf_tune.workflows.plan import plan

    dpo = method_recipe("dpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "dpo")
    result = plan(load_recipe(dpo))
    assert result["method"] == "dpo" and result["method_batch"].startswith("2 pairs per step: 4 sequences")
    # LoRA r=4 on q_proj (32 -> 32) and v_proj (32 -> 16) of 2 blocks: r * (in + out) each
    assert result["trainable_params"] == 2 * (4 * (32 + 32) + 4 * (32 + 16))
    assert "method: dpo (2 pairs per step" in format_plan(result)
    prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)])
    grpo = method_recipe("grpo", tiny_llama_dir, prompts, tmp_path / "grpo", per_device_train_batch_size=4,
                         num_generations=2, max_completion_length=4, max_steps=-1, num_train_epochs=1)
    grpo["rewards"] = ["exact_answer"]
    result = plan(load_recipe(grpo))
    assert result["method_batch"].startswith("4 completions per step: 2 prompts x 2 generations")
    assert result["steps_per_epoch"] == 8 * 2 // 4  # every prompt sampled twice, 4 completions a step
    trainer = build_run(load_recipe(grpo)).trainer
    trainer.train()
    assert trainer.state.global_step == result["total_steps"]  # the plan's count is the one GRPO takes


def test_a_dpo_run_folder_chats_merges_and_its_card_names_the_method(tmp_path, tiny_llama_dir, monkeypatch):
    from hf_tune.records.model_card import render_model_card
    from hf_tune.workflows.inference import load_trained, reply
    from hf_tune.workflows.merge_run import merge

    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    raw = method_recipe("dpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        beta=0.2, max_length=64)
    train(load_recipe(raw))
    model, tokenizer = load_trained(tmp_path / "run")
    assert isinstance(reply(model, tokenizer, [{"role": "user", "content": "Hi"}], max_new_tokens=3), str)
    result = merge(tmp_path / "run", check=True)
    assert result["max_abs_logit_diff"] <= 1e-4
    card = str(render_model_card(tmp_path / "run", "me/tiny-dpo", base_model="HuggingFaceTB/SmolLM2-135M-Instruct"))
    assert "by DPO (direct preference optimization" in card and "- dpo" in card and "- trl" in card
    assert "| beta | 0.2 |" in card and "up to 64 tokens per example" in card


def test_a_reward_model_run_merges_to_a_one_score_classifier(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForSequenceClassification

    from hf_tune.workflows.merge_run import merge

    raw = method_recipe("reward", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run")
    train(load_recipe(raw))
    result = merge(tmp_path / "run", check=True)
    merged = AutoModelForSequenceClassification.from_pretrained(result["merged_dir"])
    assert merged.config.num_labels == 1


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_process_deepspeed_dpo_with_lora_trains_the_whole_adapter(tmp_path, tiny_llama_dir, stage):

    from runs import step_losses
    from safetensors.torch import load_file

    raw = method_recipe("dpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        max_steps=3, deepspeed=stage, per_device_train_batch_size=1, learning_rate=1e-2)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    env = {"HF_TUNE_CACHE": str(tmp_path / "cache"),
           "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "hf_tune" / "torch_extensions")}
    result = launch.run(*launch.zero(2, "-m", "hf_tune.run", str(recipe)), env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert step_losses(tmp_path / "run")[0][1] == pytest.approx(math.log(2), abs=1e-5)  # both ranks: the reference
    adapter = load_file(tmp_path / "run" / "adapter_model.safetensors")
    assert len(adapter) == 2 * 2 * 2  # lora_A and lora_B of q_proj and v_proj in each of the 2 blocks
    assert all(t.numel() > 0 for t in adapter.values())
    assert all(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # B starts at 0: it trained


def test_grpo_throughput_counts_prompt_and_sampled_tokens(tmp_path, tiny_llama_dir):
    prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(4)])
    raw = method_recipe("grpo", tiny_llama_dir, prompts, tmp_path / "run", per_device_train_batch_size=4,
                        num_generations=2, max_completion_length=3, max_steps=1, beta=0.0)
    raw["rewards"] = ["exact_answer"]
    trainer = build_run(load_recipe(raw)).trainer
    seen = []
    real = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):  # the batch as GRPO prepared it, counted here independently
        seen.append((int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()),
                     int(inputs["completion_mask"].sum())))
        return real(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    totals = trainer.throughput.total
    assert totals["tokens"] == sum(t for t, _ in seen) and totals["examples"] == 4
    assert totals["trained_tokens"] == sum(c for _, c in seen)  # every sampled token is one the loss trains


@pytest.mark.slow
def test_reward_model_on_the_shipped_pairs_ranks_held_out_pairs_better_than_untrained(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "reward_model.yaml",
                         [f"training.output_dir={tmp_path / 'run'}", "training.max_steps=8", "training.eval_strategy=no",
                          "training.save_strategy=no", "training.disable_tqdm=true"])
    trainer = build_run(recipe).trainer
    pairs = trainer.eval_dataset

    def accuracy() -> float:  # the share of held-out pairs whose chosen answer scores higher, computed here
        model = trainer.model.eval()
        right = 0
        with torch.no_grad():
            for pair in pairs:
                scores = [model(input_ids=torch.tensor([pair[f"{side}_ids"]])).logits.item()
                          for side in ("chosen", "rejected")]
                right += scores[0] > scores[1]
        return right / len(pairs)

    before = accuracy()
    trainer.train()
    after = accuracy()
    assert after >= before + 0.2, (before, after)


# --- issue 29: LLaMA-Factory's KTO layout, GRPO's batch against the world size, reward columns at data load -------

def llamafactory_kto(path: Path) -> Path:
    """LLaMA-Factory's KTO layout: ``messages`` ending in the assistant's answer, and a boolean ``label``."""
    rows = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": answer}], "label": label}
            for p, c, r in PAIRS for answer, label in ((c, True), (r, False))]
    path.write_text(json.dumps(rows))
    return path


def test_llamafactory_kto_layout_reads_as_prompt_completion_label(tmp_path):
    rows = load_pairs(llamafactory_kto(tmp_path / "kto.json"), "kto")
    expected = [({"role": "user", "content": p}, answer, label) for p, c, r in PAIRS
                for answer, label in ((c, True), (r, False))]
    assert [(row["prompt"], row["completion"], row["label"]) for row in rows] == \
           [([user], [{"role": "assistant", "content": answer}], label) for user, answer, label in expected]


def test_kto_trains_on_the_llamafactory_layout_with_the_closed_form_loss(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    raw = method_recipe("kto", tiny_llama_dir, llamafactory_kto(tmp_path / "kto.json"), tmp_path / "run",
                        per_device_train_batch_size=4, max_steps=1, learning_rate=1e-6, desirable_weight=1.0,
                        undesirable_weight=1.0)
    run = build_run(load_recipe(raw))
    run.trainer.train()
    assert logged(run.trainer, "loss")[0] == pytest.approx(1 - 1 / (1 + math.exp(0)), abs=1e-6)


def test_grpo_generations_must_fill_the_batch_of_every_process(tmp_path, tiny_llama_dir, monkeypatch):
    from hf_tune.recipe.schedule_checks import check_generations

    prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}])
    raw = method_recipe("grpo", tiny_llama_dir, prompts, tmp_path / "run", per_device_train_batch_size=2,
                        num_generations=4)
    raw["rewards"] = ["exact_answer"]
    with pytest.raises(RecipeError) as refused:
        read_recipe(raw)  # this launch: one process holds 2 completions, half a group of 4
    assert refused.value.key == "training.per_device_train_batch_size" and "2 per device x 1 process" in str(refused.value)
    recipe = read_recipe({**raw, "training": {**raw["training"], "gradient_accumulation_steps": 2}})
    check_generations(recipe, world_size=1)  # 2 per device x 2 steps per generation = one group of 4
    recipe = read_recipe({**raw, "training": {**raw["training"], "per_device_train_batch_size": 4}})
    for world_size in (1, 2, 3):
        check_generations(recipe, world_size)
    six = {**raw, "training": {**raw["training"], "per_device_train_batch_size": 6}}
    with pytest.raises(RecipeError, match="6 per device x 1 process"):
        read_recipe(six)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: 12 completions, 3 groups of 4
    check_generations(read_recipe(six), world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(RecipeError, match="6 per device x 3 process"):
        read_recipe(six)


def test_a_custom_rewards_columns_are_checked_when_the_data_loads(tmp_path, tiny_llama_dir):
    from hf_tune.data.preference import load_method_data

    (tmp_path / "graded_rewards.py").write_text(
        "def by_difficulty(prompts, completions, difficulty, scale=1.0, **columns):\n"
        "    return [scale * float(d) for d in difficulty]\n")
    sys.path.insert(0, str(tmp_path))
    try:
        prompts = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}] * 2)
        raw = method_recipe("grpo", tiny_llama_dir, prompts, tmp_path / "run", per_device_train_batch_size=2,
                            num_generations=2)
        raw["rewards"] = ["exact_answer", "graded_rewards:by_difficulty"]
        recipe = read_recipe(raw)
        with pytest.raises(RecipeError) as refused:
            load_method_data(recipe.data, recipe.method, 0, recipe.rewards)
        assert refused.value.key == "rewards[1]"
        assert f"['difficulty'], which data.train ({prompts}) lacks: it has ['prompt', 'answer']" in str(refused.value)
        graded = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2", "difficulty": 1}] * 2)
        recipe = read_recipe({**raw, "data": {"train": {"path": str(graded)}}})
        assert len(load_method_data(recipe.data, recipe.method, 0, recipe.rewards)[0]) == 2
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("graded_rewards", None)
