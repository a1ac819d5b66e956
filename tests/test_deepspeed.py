"""Bundled DeepSpeed configs, their checks at recipe load, and a real 2-process ZeRO-3 run on CPU (gloo)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import launch
import pytest
import yaml
from conftest import REPO, chat_recipe, free_port
from inputs import WD, expected

from hf_tune import build_training_arguments, load_recipe
from hf_tune.errors import HfTuneError

CONFIGS = sorted((REPO / "hf_tune" / "ds_configs").glob("*.json"))
MIRRORED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_bundled_configs_leave_optimizer_schedule_and_batch_to_trainer(path):
    config = json.loads(path.read_text())
    assert "optimizer" not in config and "scheduler" not in config  # they would replace hf_tune's groups / schedule
    assert all(config[key] == "auto" for key in MIRRORED)
    assert config["bf16"]["enabled"] == "auto" and config["fp16"]["enabled"] == "auto"
    zero = config["zero_optimization"]
    assert zero["stage"] == int(path.stem[4])
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert ("offload" in path.stem) == ("offload_optimizer" in zero)


def test_a_recipe_names_a_bundled_config_by_short_name(tmp_path, tiny_llama_dir):
    recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", deepspeed="zero2"))
    assert recipe.training["deepspeed"] == "zero2"  # what recipe.yaml, run.json and the card show: no machine path
    shipped = json.loads((REPO / "hf_tune" / "ds_configs" / "zero2.json").read_text())
    assert build_training_arguments(recipe).deepspeed == shipped  # Trainer gets the bundled JSON itself
    with pytest.raises(HfTuneError, match=r"(?s)training.deepspeed: file not found: zero5.*zero3_offload"):
        load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", deepspeed="zero5"))


def test_a_lock_left_by_a_killed_op_build_is_refused_instead_of_waited_on_for_ever(tmp_path, tiny_llama_dir,
                                                                                     monkeypatch):
    build = tmp_path / "extensions" / "py311_cpu" / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    lock, source = build / "lock", build / "build.ninja"
    lock.write_text(""), source.write_text("rule cxx\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", deepspeed="zero2"))
    assert build_training_arguments(recipe).deepspeed  # a build under way (its folder just written): not refused
    an_hour_ago = time.time() - 3600
    for path in (lock, source):
        os.utime(path, (an_hour_ago, an_hour_ago))
    with pytest.raises(HfTuneError, match=rf"(?s)wait for ever on {lock}.*'deepspeed_shm_comm' was interrupted 60 "
                                          rf"minutes ago.*fix: delete {lock}"):
        build_training_arguments(recipe)
    lock.unlink()
    assert build_training_arguments(recipe).deepspeed  # without the lock: DeepSpeed builds the op itself


def test_a_contradicting_value_names_both_keys(tmp_path, tiny_llama_dir):
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(HfTuneError, match="train_micro_batch_size_per_gpu=4 but training.per_device_train_batch_size is 2"):
        load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", deepspeed=str(path)))
    config["train_micro_batch_size_per_gpu"], config["zero_optimization"]["stage"] = "auto", 4
    path.write_text(json.dumps(config))
    with pytest.raises(HfTuneError, match="unknown ZeRO stage 4"):
        load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", deepspeed=str(path)))
    path.write_text("{not json")
    with pytest.raises(HfTuneError, match="is not valid JSON"):
        load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", deepspeed=str(path)))


ZERO_LR, ZERO_DECAY = 3e-3, 0.7


def zero_llrd_recipe(model_dir: str, folder: Path, stage: str) -> Path:
    """A 16-step full fine-tune under ZeRO ``stage`` with layer-wise LR decay and weight decay (on what the rule of
    inputs.expected decays), a checkpoint every 4 steps."""
    raw = chat_recipe(model_dir, folder, max_steps=16, deepspeed=stage, save_strategy="steps", save_steps=4,
                      learning_rate=ZERO_LR, weight_decay=WD, seed=5)
    raw["optim"] = {"layerwise_lr_decay": ZERO_DECAY}
    path = folder.parent / f"{folder.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def deepspeed_command(recipe: Path) -> list[str]:
    """``python -m hf_tune.run RECIPE`` on 2 ranks (launch.zero: torchrun starts them)."""
    return launch.zero(2, "-m", "hf_tune.run", str(recipe))


DEEPSPEED_ENV = {"TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "hf_tune" / "torch_extensions")}


@pytest.fixture(scope="module")
def uninterrupted_zero_run(tmp_path_factory, tiny_llama_dir):
    """stage -> (run folder, port, finished launch, per-rank reports) of one uninterrupted 2-process run of
    ``zero_llrd_recipe``, launched once per module as ``python -m hf_tune.run`` runs it, through
    tests/deepspeed_probe.py whole-run, which then reports each rank's optimizer groups and parameter storage: the
    reference of the kill-and-resume tests, the full fine-tune the ZeRO-3 save test loads, and the run whose
    partitions and LLRD groups the ZeRO-3 probe test reads (one launch for the three)."""
    runs = {}

    def run(stage: str):
        if stage not in runs:
            folder = tmp_path_factory.mktemp(f"uninterrupted-{stage}") / "run"
            report = folder.parent / "report.json"
            recipe = zero_llrd_recipe(tiny_llama_dir, folder, stage)
            command = launch.zero(2, str(REPO / "tests" / "deepspeed_probe.py"), str(recipe), str(report), "whole-run")
            port = int(command[command.index("--master_port") + 1])
            result = launch.run(*command, env=DEEPSPEED_ENV, timeout=900)
            assert result.returncode == 0, result.stderr[-3000:]
            reports = [json.loads(Path(f"{report}.rank{rank}").read_text()) for rank in (0, 1)]
            runs[stage] = folder, port, result, reports
        return runs[stage]

    return run


@pytest.mark.slow
def test_two_process_zero3_full_fine_tune_saves_a_model_that_loads(tiny_llama_dir, uninterrupted_zero_run):
    from transformers import AutoModelForCausalLM

    run_dir, port, result, _ = uninterrupted_zero_run("zero3")
    # DeepSpeed's CPU all-reduce segments (64 MB of RAM per rank) are gone with the run, not left in /dev/shm
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    output = result.stdout + result.stderr
    assert "rank 0 of 2" in output and "rank 1 of 2" in output
    assert json.loads((run_dir / "run.json").read_text())["world_size"] == 2
    saved = AutoModelForCausalLM.from_pretrained(run_dir)  # consolidated from the ZeRO-3 shards
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    for (name, p), (_, q) in zip(saved.named_parameters(), base.named_parameters()):
        assert p.shape == q.shape and p.numel() > 0, name
    assert any(not (p == q).all() for p, q in zip(saved.parameters(), base.parameters()))  # it trained


def kill_after(recipe: Path, checkpoint: Path) -> str:
    """Launch ``recipe`` on 2 DeepSpeed ranks and SIGKILL the launcher and both ranks once ``checkpoint`` is complete.
    Returns what the launch printed until then."""
    import time

    from hf_tune.trainer.checkpoints import is_complete

    log = checkpoint.parent.parent / f"{checkpoint.parent.name}-killed.log"
    with log.open("w") as out:
        proc = launch.start(*deepspeed_command(recipe), env=DEEPSPEED_ENV, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while not is_complete(checkpoint):
            assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
            time.sleep(0.05)
        kill_tree(proc.pid)
        proc.wait()
    return log.read_text()


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it at once (torchrun's ranks do not share its process group)."""
    import psutil

    launcher = psutil.Process(pid)
    for process in [*launcher.children(recursive=True), launcher]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def assert_same_as_uninterrupted(run_dir: Path, reference_dir: Path) -> None:
    """Every step's loss and every tensor of the consolidated model, bit for bit."""
    import torch
    from safetensors.torch import load_file

    def losses(folder):
        history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
        return [(e["step"], e["loss"]) for e in history if "loss" in e]

    assert len(losses(run_dir)) == 16 and losses(run_dir) == losses(reference_dir)
    mine, theirs = load_file(run_dir / "model.safetensors"), load_file(reference_dir / "model.safetensors")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_two_process_zero3_with_llrd_killed_and_resumed_matches_the_uninterrupted_run(tmp_path, tiny_llama_dir,
                                                                                      uninterrupted_zero_run):
    reference_dir, _, _, _ = uninterrupted_zero_run("zero3")
    killed = zero_llrd_recipe(tiny_llama_dir, tmp_path / "killed", "zero3")
    kill_after(killed, tmp_path / "killed" / "checkpoint-8")
    resumed = launch.run(*deepspeed_command(killed), env=DEEPSPEED_ENV, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resuming from" in resumed.stdout + resumed.stderr
    assert_same_as_uninterrupted(tmp_path / "killed", reference_dir)


@pytest.mark.slow
def test_two_process_zero2_sigterm_to_one_rank_then_a_kill_resume_to_the_uninterrupted_run(tmp_path, tiny_llama_dir,
                                                                                           uninterrupted_zero_run):
    """SIGTERM to rank 1 alone as step 6 begins (saves every 4): both ranks write their ZeRO shards of checkpoint-6
    and exit 75 (training.enable_jit_checkpoint, on by default). The rerun resumes from checkpoint-6 and is killed
    (SIGKILL, launcher and ranks) once checkpoint-12 is complete; the third launch resumes from checkpoint-12 and
    ends bit-identical to the uninterrupted run, LLRD groups and all (one run for the signal and the kill)."""
    from hf_tune.errors import EXIT_PREEMPTED
    from hf_tune.trainer.checkpoints import is_complete

    reference_dir, _, _, _ = uninterrupted_zero_run("zero2")
    run_dir = tmp_path / "stopped"
    recipe = zero_llrd_recipe(tiny_llama_dir, run_dir, "zero2")
    stopped = launch.run("deepspeed", "--no_local_rank", "--num_gpus", "2", "--master_port", str(free_port()),
                         "tests/preemption_probe.py", str(recipe), "6", "TERM", "1", env=DEEPSPEED_ENV, timeout=900)
    assert [json.loads((run_dir / f"exit-rank{r}.json").read_text())["status"] for r in (0, 1)] == \
        [EXIT_PREEMPTED] * 2, stopped.stderr[-3000:]
    assert is_complete(run_dir / "checkpoint-6") and len(list((run_dir / "checkpoint-6").rglob("*optim_states.pt"))) == 2
    assert not json.loads((run_dir / "run.json").read_text())["end_time"]
    killed = kill_after(recipe, run_dir / "checkpoint-12")
    assert "checkpoint-6" in killed.split("Resuming from", 1)[1][:300]
    assert not (run_dir / "model.safetensors").exists()
    resumed = launch.run(*deepspeed_command(recipe), env=DEEPSPEED_ENV, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-12" in (resumed.stdout + resumed.stderr).split("Resuming from", 1)[1][:300]
    assert_same_as_uninterrupted(run_dir, reference_dir)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_memory_estimate_agrees_with_deepspeeds_own_estimators_for_a_full_fine_tune(world):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from hf_tune.workflows.plan import model_state_memory

    total, largest = 134_515_008, 28_311_552  # SmolLM2-135M: all parameters; its embedding, the largest module
    ours = model_state_memory(total, total, largest, world, mixed_precision=True, param_bytes=4)
    assert ours["ZeRO-2"][0] == pytest.approx(estimate_zero2_model_states_mem_needs(total, world, 1, False)[1], abs=1)
    assert ours["ZeRO-2 offload"][0] == estimate_zero2_model_states_mem_needs(total, world, 1, True)[1]
    zero3 = estimate_zero3_model_states_mem_needs(total, largest, world, 1, cpu_offload=False)
    assert ours["ZeRO-3"][0] == pytest.approx(zero3[1], abs=1)
    offload = estimate_zero3_model_states_mem_needs(total, largest, world, 1, cpu_offload=True, cpu_offload_params=True)
    assert ours["ZeRO-3 offload"][0] == offload[1]
    assert ours["ZeRO-3 offload"][1] == pytest.approx(offload[0] / 1.5 / world)  # per rank, without its 1.5 buffer


def test_plan_prints_model_state_memory_per_rank_for_lora_and_full(tmp_path, tiny_llama_dir):
    """Counts from the tiny Llama's config by hand: fp32, world size 4, AdamW."""
    from hf_tune.commands.plan import format_plan
    from hf_tune.workflows.plan import plan

    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    d, f, L, V = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
    total = V * d + L * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + d  # tied embedding, blocks, final norm
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    full = plan(load_recipe(raw), world_size=4, out_dir=tmp_path / "p1")
    memory = full["memory_per_rank"]
    assert memory["no ZeRO (DDP)"] == (16 * total, 0)  # weight, gradient, two moments: 4 bytes each
    assert memory["ZeRO-2"] == (4 * total + 12 * total / 4, 0)
    assert memory["ZeRO-3"] == (4 * V * d + 16 * total / 4, 0)  # the embedding is the largest module
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    adapters = L * 4 * ((d + d) + (d + kv))
    lora = plan(load_recipe(raw), world_size=4, out_dir=tmp_path / "p2")["memory_per_rank"]
    assert lora["no ZeRO (DDP)"] == (4 * (total + adapters) + 12 * adapters, 0)
    assert lora["ZeRO-3 offload"] == (4 * V * d, (4 * (total + adapters) + 12 * adapters) / 4)
    assert "ZeRO-3 offload" in format_plan(full) and "activations not included" in format_plan(full)


@pytest.mark.slow
def test_two_process_zero3_partitions_every_parameter_and_steps_the_llrd_groups(tiny_llama_dir, uninterrupted_zero_run):
    """Inside a real 2-rank ZeRO-3 run (the uninterrupted one, as it ends): each rank stores half of every parameter,
    and the optimizer DeepSpeed steps holds hf_tune's layer-wise groups (LR and weight decay as the rule in
    inputs.expected computes them)."""
    import collections

    from transformers import AutoModelForCausalLM

    *_, reports = uninterrupted_zero_run("zero3")
    assert [r["world_size"] for r in reports] == [2, 2] and "Stage3" in reports[0]["wrapper"]

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    persistence = 10 * model.config.hidden_size  # Trainer's "auto" stage3_param_persistence_threshold
    partitioned = 0
    for name, p in model.named_parameters():
        stored = [r["params"][name] for r in reports]
        assert all(s["full"] == p.numel() and s["shard"] == math.ceil(p.numel() / 2) for s in stored), name
        if p.numel() >= persistence:  # half on each rank, the full tensor gathered only while it is used
            assert all(s["local"] == 0 for s in stored), name
            partitioned += p.numel()
    assert partitioned > 0.99 * sum(p.numel() for p in model.parameters())

    want = collections.Counter()
    for name, p in model.named_parameters():
        want[expected(name, "llama", 2, ZERO_DECAY, base_lr=ZERO_LR)] += p.numel()
    assert len(want) == 6
    for rank_report in reports:
        got = {(g["initial_lr"], g["weight_decay"]): g["numel"] for g in rank_report["groups"]}
        assert len(got) == 6
        for (lr, wd), numel in want.items():  # each rank steps its half of every group
            match = [n for (glr, gwd), n in got.items() if glr == pytest.approx(lr) and gwd == wd]
            assert len(match) == 1 and numel / 2 <= match[0] < numel / 2 + 64, ((lr, wd), numel, match)
