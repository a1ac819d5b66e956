"""ORPO and SimPO (preference pairs, no reference model), RLOO (rewards, leave-one-out baseline) and distillation
(a frozen teacher): each an entry of hf_tune's method table, each loss written here from its paper's formula on
log-probabilities or logits, never read back from TRL."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, save_tiny_llama
from inputs import conversational_pairs, method_recipe, write_jsonl

from hf_tune import load_recipe
from hf_tune.assembly.run_build import build_run
from hf_tune.errors import RecipeError


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def pair_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum, token count) of the completion tokens' log-probabilities of the chosen and of the rejected sequences of
    a TRL pair batch (``chosen_input_ids`` / ``chosen_labels``, -100 on the prompt), written here."""
    out = []
    for side in ("chosen", "rejected"):
        logits = model(input_ids=batch[f"{side}_input_ids"], attention_mask=batch[f"{side}_attention_mask"]).logits
        labels = batch[f"{side}_labels"][:, 1:]
        mask = labels != -100
        token_logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0).unsqueeze(-1))
        out += [(token_logps.squeeze(-1) * mask).sum(1), mask.sum(1)]
    return tuple(out)


def moved_adapter(model, seed: int = 0) -> None:
    """Moves LoRA's B away from 0 so that chosen and rejected log-probabilities differ more than at initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)


# --- ORPO and SimPO -----------------------------------------------------------------------------------------------

def test_orpo_loss_is_the_chosen_nll_minus_lambda_log_sigmoid_of_the_log_odds_ratio(tmp_path, tiny_llama_dir):
    """Hong et al. 2024, eq. 6-7: L = NLL(chosen) - lambda * log sigmoid(log odds(chosen) - log odds(rejected)),
    odds(y) = P(y) / (1 - P(y)) with P(y) the geometric mean of the response's token probabilities (exp of their mean
    log). The NLL term is the next-token loss over the whole chosen sequence, prompt included, as the authors' code
    and TRL compute it (docs/methods.md)."""
    raw = method_recipe("orpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        beta=0.25, per_device_train_batch_size=3)
    trainer = build_run(load_recipe(raw)).trainer
    model = trainer.model
    moved_adapter(model)
    batch = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        chosen_sum, chosen_n, rejected_sum, rejected_n = pair_logps(model, batch)
        mean_c, mean_r = chosen_sum / chosen_n, rejected_sum / rejected_n
        log_odds = (mean_c - torch.log1p(-torch.exp(mean_c))) - (mean_r - torch.log1p(-torch.exp(mean_r)))
        # the NLL term covers the chosen sequence's every token, prompt included (the authors' code, TRL)
        logits = model(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits
        targets = batch["chosen_input_ids"].masked_fill(batch["chosen_attention_mask"] == 0, -100)[:, 1:]
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        expected = nll - 0.25 * F.logsigmoid(log_odds).mean()
        got = trainer.compute_loss(model, batch)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert F.logsigmoid(log_odds).mean().abs() > 1e-3  # the odds-ratio term is part of what was compared


def test_simpo_loss_is_the_length_normalised_margin(tmp_path, tiny_llama_dir):
    """Meng et al. 2024, eq. 6: L = -log sigmoid(beta * (mean log p(chosen) - mean log p(rejected)) - gamma); hf_tune's
    simpo is TRL's CPO with loss_type simpo and no NLL term (cpo_alpha 0), and no reference model."""
    raw = method_recipe("simpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        beta=2.0, simpo_gamma=0.3, per_device_train_batch_size=3)
    trainer = build_run(load_recipe(raw)).trainer
    assert (trainer.args.loss_type, trainer.args.cpo_alpha) == ("simpo", 0.0)
    model = trainer.model
    moved_adapter(model, seed=1)
    batch = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        chosen_sum, chosen_n, rejected_sum, rejected_n = pair_logps(model, batch)
        margin = chosen_sum / chosen_n - rejected_sum / rejected_n
        expected = -F.logsigmoid(2.0 * margin - 0.3).mean()
        got = trainer.compute_loss(model, batch)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert margin.abs().max() > 1e-3


def test_simpo_refuses_a_loss_type_that_is_not_simpo(tmp_path, tiny_llama_dir):
    raw = method_recipe("simpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        loss_type="sigmoid")
    with pytest.raises(RecipeError, match=r"training.loss_type: method 'simpo' runs CPOConfig with loss_type "
                                          r"'simpo', the recipe sets 'sigmoid'\n  fix: remove training.loss_type"):
        load_recipe(raw)


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_orpo_and_simpo_train_with_lora_llrd_groups_and_the_schedule(tmp_path, tiny_llama_dir, method):
    raw = method_recipe(method, tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"), tmp_path / "run",
                        max_steps=4, warmup_steps=1, lr_scheduler_type="cosine", learning_rate=1e-3)
    raw["optim"] = {"layerwise_lr_decay": 0.5}
    trainer = build_run(load_recipe(raw)).trainer
    seen, real = [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):  # each pair batch's tokens, counted here independently
        seen.append(int(inputs["chosen_attention_mask"].sum() + inputs["rejected_attention_mask"].sum()))
        return real(model, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    peak_of = {id(p): g["initial_lr"] for g in trainer.optimizer.param_groups for p in g["params"]}
    trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert len(peak_of) == len(trained)
    for name, param in trained:  # 2 blocks: block i at depth i + 1, its peak LR 1e-3 * 0.5 ** (2 - block)
        block = int(name.split(".layers.")[1].split(".")[0])
        assert peak_of[id(param)] == pytest.approx(1e-3 * 0.5 ** (2 - block))
    # warmup over step 1, then cosine to 0 over the 3 steps left; Trainer logs at step s the LR step s ran with
    peak = 1e-3 * 0.5 ** 2  # the first group: block 0
    assert logged(trainer, "learning_rate") == pytest.approx(
        [0.0] + [peak * 0.5 * (1 + math.cos(math.pi * k / 3)) for k in range(3)])
    factors = {g["lr"] / g["initial_lr"] for g in trainer.optimizer.param_groups}
    assert len({round(f, 12) for f in factors}) == 1  # every group on the one schedule
    losses = logged(trainer, "loss")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    totals = trainer.throughput.total  # both sides of every pair: 4 steps of 2 pairs
    assert totals["tokens"] == sum(seen) and totals["examples"] == 4 * 2 * 2


# --- RLOO ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def length_reward(tmp_path):
    """A reward module on sys.path: the character count of each completion mod 3, each call's scores recorded."""
    (tmp_path / "length_rewards.py").write_text(
        "SEEN = []\n\ndef length_reward(prompts, completions, **columns):\n"
        "    scores = [float(len(c[-1]['content'] if isinstance(c, list) else c) % 3) for c in completions]\n"
        "    SEEN.append(scores)\n    return scores\n")
    sys.path.insert(0, str(tmp_path))
    import length_rewards

    yield length_rewards
    sys.path.remove(str(tmp_path))
    sys.modules.pop("length_rewards", None)


def prompts_file(path: Path, n: int = 8) -> Path:
    return write_jsonl(path, [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}], "answer": str(a + 1)}
                              for a in range(n)])


def test_rloo_advantages_are_leave_one_out_and_its_gradient_is_reinforces(tmp_path, tiny_llama_dir, length_reward):
    """Ahmadian et al. 2024: A_i = r_i - mean of the group's other rewards, and the policy gradient is
    -mean_i(A_i * grad log p(y_i)) with log p(y_i) summed over the completion's tokens (one update per sampling: the
    importance ratio is 1, so clipping never acts)."""
    raw = method_recipe("rloo", tiny_llama_dir, prompts_file(tmp_path / "q.jsonl"), tmp_path / "run",
                        per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=1,
                        beta=0.0, normalize_advantages=False, temperature=1.0)
    raw["rewards"] = ["length_rewards:length_reward"]
    trainer = build_run(load_recipe(raw)).trainer
    batches, gradients, real = [], [], trainer.compute_loss
    model = trainer.model

    def gradient(loss_of) -> list[torch.Tensor]:
        model.zero_grad()
        loss_of().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        return grads

    def written_here(batch):  # at the weights that sampled the batch, before the step
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        n = batch["completion_ids"].shape[1]
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -n - 1:-1].float()  # temperature 1
        token = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
        logp = (token * batch["completion_mask"]).sum(1)
        return -(batch["advantages"] * torch.exp(logp - logp.detach())).mean()

    def recording(model_, inputs, *args, **kwargs):
        batches.append(inputs)
        gradients.append((gradient(lambda: written_here(inputs)), gradient(lambda: real(model_, inputs))))
        return real(model_, inputs, *args, **kwargs)

    trainer.compute_loss = recording
    trainer.train()
    (batch,) = batches
    tokenizer = trainer.processing_class  # the batch is shuffled after scoring: each row's reward recomputed here
    texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(batch["completion_ids"], batch["completion_mask"])]
    rewards = torch.tensor([float(len(text) % 3) for text in texts])
    assert sorted(rewards.tolist()) == sorted(length_reward.SEEN[0])
    k = 4  # one prompt, its 4 completions
    groups = rewards.view(-1, k)
    expected = (groups - (groups.sum(1, keepdim=True) - groups) / (k - 1)).view(-1)
    assert batch["advantages"] == pytest.approx(expected.tolist(), abs=1e-6)
    assert expected.abs().max() > 0  # the rewards differ within a group: the check has a gradient to compare
    ((mine, theirs),) = gradients
    assert all(torch.allclose(a, b, atol=1e-7, rtol=1e-4) for a, b in zip(mine, theirs))
    assert any(g.abs().max() > 0 for g in mine)


# --- distillation -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, smol_tokenizer) -> str:
    """Another random tiny Llama (seed 1) with the student's tokenizer, its head scaled up so that its next-token
    distributions are peaked: far from the student's near-uniform ones, a divergence the student can close."""
    from transformers import AutoModelForCausalLM

    folder = Path(save_tiny_llama(tmp_path_factory.mktemp("teacher"), smol_tokenizer, seed=1))
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8)
    model.save_pretrained(folder)
    return str(folder)


def reverse_kl(student, teacher, batch) -> torch.Tensor:
    """Gu et al. 2024 (MiniLLM) / Agarwal et al. 2024 (GKD, beta = 1): KL(student || teacher) of the next-token
    distributions at each completion position, averaged over the completion tokens, written here."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    n = batch["completion_ids"].shape[1]
    log_s = torch.log_softmax(student(input_ids=ids, attention_mask=mask).logits[:, -n - 1:-1].float(), -1)
    with torch.no_grad():
        log_t = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits[:, -n - 1:-1].float(), -1)
    per_token = (log_s.exp() * (log_s - log_t)).sum(-1)
    return (per_token * batch["completion_mask"]).sum() / batch["completion_mask"].sum()


def distillation_recipe(tmp_path: Path, student: str, teacher: str, **training) -> dict:
    training = {"per_device_train_batch_size": 4, "max_completion_length": 6, **training}
    raw = method_recipe("distillation", student, prompts_file(tmp_path / "q.jsonl"), tmp_path / "run", lora=False,
                        **training)
    raw["teacher"] = {"pretrained_model_name_or_path": teacher}
    return raw


def test_distillation_loss_is_the_reverse_kl_to_the_frozen_teacher_and_it_falls(tmp_path, tiny_llama_dir,
                                                                                 teacher_dir):
    raw = distillation_recipe(tmp_path, tiny_llama_dir, teacher_dir, max_steps=12, learning_rate=1e-2,
                              lr_scheduler_type="constant")
    trainer = build_run(load_recipe(raw)).trainer
    teacher = trainer.teacher_model
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    before = {name: p.clone() for name, p in teacher.named_parameters()}
    batches, step_one, real = [], [], trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        batches.append(inputs)
        loss = real(model, inputs, *args, **kwargs)
        if len(batches) == 1:
            with torch.no_grad():
                step_one.append((loss.item(), reverse_kl(model, teacher, inputs).item()))
        return loss

    trainer.compute_loss = recording
    trainer.train()
    ((loss, expected),) = step_one
    assert loss == pytest.approx(expected, rel=1e-4)
    assert all(torch.equal(before[name], p) for name, p in teacher.named_parameters())  # frozen
    with torch.no_grad():  # the same sampled sequences, scored by the student before and after: it moved closer
        first = batches[0]
        after = reverse_kl(trainer.model, teacher, first).item()
    assert after < 0.85 * expected
    losses = logged(trainer, "loss")  # and the divergence of each step's fresh samples fell too
    assert sum(losses[-3:]) < 0.85 * sum(losses[:3])


def test_a_teacher_of_another_vocabulary_is_refused_by_its_key(tmp_path, tiny_llama_dir, smol_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(smol_tokenizer) + 64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    smol_tokenizer.save_pretrained(tmp_path / "other")
    raw = distillation_recipe(tmp_path, tiny_llama_dir, str(tmp_path / "other"))
    with pytest.raises(RecipeError, match=rf"teacher.pretrained_model_name_or_path: {tmp_path / 'other'} has a "
                                          rf"vocabulary of {len(smol_tokenizer) + 64} tokens, the student "
                                          rf"{len(smol_tokenizer)}"):
        build_run(load_recipe(raw))


def test_the_plan_shows_no_reference_for_orpo_and_the_teachers_memory_partitioned_under_zero3(
        tmp_path, tiny_llama_dir, teacher_dir):
    from transformers import AutoModelForCausalLM

    from hf_tune.commands.plan import format_plan
    from hf_tune.workflows.plan import plan

    orpo = plan(load_recipe(method_recipe("orpo", tiny_llama_dir, conversational_pairs(tmp_path / "p.jsonl"),
                                          tmp_path / "orpo")))
    assert orpo["reference"] == "none" and orpo["method_batch"].startswith("2 pairs per step: 4 sequences")
    assert "reference model: none" in format_plan(orpo)
    weights = sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(teacher_dir).parameters())
    raw = distillation_recipe(tmp_path, tiny_llama_dir, teacher_dir)
    alone = plan(load_recipe(raw), world_size=2)
    assert alone["method_batch"].startswith("8 prompts per step, one completion each sampled by the student")
    assert alone["teacher"]["bytes"] == weights and alone["teacher"]["bytes_per_rank"] == weights  # whole per rank
    raw["training"]["deepspeed"] = str(REPO / "ds_configs" / "zero3.json")
    partitioned = plan(load_recipe(raw), world_size=2)
    assert partitioned["teacher"]["bytes_per_rank"] == weights // 2
    text = format_plan(partitioned)
    assert f"{partitioned['teacher']['params']:,} parameters in float32, frozen" in text
    assert "partitioned over the ranks (ZeRO-3)" in text and "+ the teacher's weights" in text
    from hf_tune.model.memory import RUNTIME_RESERVE_BYTES

    student = partitioned["memory_per_rank"][partitioned["setup"]][0]  # the peak counts the teacher beside them
    # and the keys and values of the student's sampling: 2 layers x 2 kv heads x head_dim 8, float32, K and V
    cache = 2 * 2 * 2 * 8 * 4 * partitioned["decisions"]["micro_batch_tokens"]
    assert partitioned["peak_per_rank"] == (student + partitioned["activations"]["peak_bytes"] + RUNTIME_RESERVE_BYTES
                                            + weights // 2 + cache)


def test_orpo_resumed_from_its_checkpoint_trains_the_same_losses_and_adapter_bit_for_bit(tmp_path, tiny_llama_dir):
    """Run A trains 6 steps, saving at 3 and 6; run B resumes from A's checkpoint-3 in another folder. B's steps 4-6
    must log A's losses and end on A's adapter exactly: the data order, the RNG and the optimizer state all restored."""
    from safetensors.torch import load_file

    from hf_tune import train

    data = conversational_pairs(tmp_path / "p.jsonl")

    def recipe(name: str, **training):
        return load_recipe(method_recipe("orpo", tiny_llama_dir, data, tmp_path / name, max_steps=6,
                                         save_strategy="steps", save_steps=3, learning_rate=5e-3, seed=3, **training))

    a = train(recipe("a"))
    b = train(recipe("b", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3")))
    steps = lambda trainer: {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}  # noqa: E731
    assert sorted(steps(b)) == [1, 2, 3, 4, 5, 6]  # 1-3 from the checkpoint's state, 4-6 trained by B
    assert steps(b) == steps(a)
    assert not (tmp_path / "b" / "checkpoint-3").exists() and (tmp_path / "b" / "checkpoint-6").exists()  # B began at 3
    mine, theirs = load_file(tmp_path / "b" / "adapter_model.safetensors"), load_file(
        tmp_path / "a" / "adapter_model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_plan_shows_rloos_reference_only_with_its_kl_penalty(tmp_path, tiny_llama_dir):
    from hf_tune.workflows.plan import plan

    for beta, reference in ((0.0, "none"), (0.05, "the base with the adapter disabled (no copy)")):
        raw = method_recipe("rloo", tiny_llama_dir, prompts_file(tmp_path / "q.jsonl"), tmp_path / "run",
                            per_device_train_batch_size=4, num_generations=2, beta=beta)
        raw["rewards"] = ["exact_answer"]
        assert plan(load_recipe(raw))["reference"] == reference


@pytest.mark.slow
def test_under_zero3_the_teacher_is_partitioned_over_the_ranks_and_frozen(tmp_path, tiny_llama_dir, teacher_dir):
    """One 2-rank ZeRO-3 launch (torchrun): each rank holds only its shard of every teacher weight (DeepSpeed pads
    each to a multiple of the ranks: ceil(n / 2) here, counted from the teacher's own files), none trainable, and
    the run trains with LoRA on the student."""
    import json

    import launch
    import yaml
    from transformers import AutoModelForCausalLM

    raw = distillation_recipe(tmp_path, tiny_llama_dir, teacher_dir, per_device_train_batch_size=2, max_steps=2,
                              deepspeed="zero3")
    raw["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    env = {"TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "hf_tune" / "torch_extensions")}
    result = launch.run(*launch.zero(2, str(REPO / "tests" / "distillation_zero3_probe.py"), str(recipe),
                                     str(tmp_path / "report")), env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    weights = [p.numel() for p in AutoModelForCausalLM.from_pretrained(teacher_dir).parameters()]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report.{rank}").read_text())
        assert report["teacher_numel"] == sum(weights) and report["teacher_trainable"] == 0
        assert report["teacher_local"] == sum(math.ceil(n / 2) for n in weights)  # a shard, not the whole
        assert len(report["losses"]) == 2 and all(loss > 0 for loss in report["losses"])
