"""Resuming on another number of processes: a 2-rank DDP checkpoint resumed on 1 rank, a 1-rank one on 2 (real
torchrun launches on CPU, gloo), and the refusals that keep a resume from being silently wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import launch
import pytest
import torch
import yaml
from conftest import REPO, chat_recipe
from safetensors.torch import load_file

BIN = Path(sys.executable).parent
TORCH_EXTENSIONS = Path.home() / ".cache" / "hf_tune" / "torch_extensions"  # DeepSpeed's CPU ops, built once
ROWS, BATCH, STEPS, SAVE = 24, 2, 9, 4  # 2 examples per rank and micro-batch, global batch 4: 6 steps an epoch


def recipe_file(folder: Path, tiny_llama_dir: str, run_dir: Path, accumulation: int) -> Path:
    raw = chat_recipe(tiny_llama_dir, run_dir, max_steps=STEPS, save_strategy="steps", save_steps=SAVE, seed=5,
                      per_device_train_batch_size=BATCH, gradient_accumulation_steps=accumulation)
    rows = (REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines()[:ROWS]
    (folder / "train.jsonl").write_text("\n".join(rows) + "\n")
    raw["data"]["train"]["path"] = str(folder / "train.jsonl")
    path = folder / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def torchrun(ranks: int, recipe: Path) -> subprocess.CompletedProcess:
    result = launch.run(*launch.torchrun(ranks, "tests/resume_probe.py", str(recipe)), threads=True,
                        env={"TORCH_EXTENSIONS_DIR": str(TORCH_EXTENSIONS)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def one_process(recipe: Path) -> subprocess.CompletedProcess:
    """A run on one process without a launcher (as ``python -m hf_tune.run`` runs it), one CPU thread as each rank
    of the 2-rank launches has: the same kernels on the same shapes."""
    result = launch.run("python", "tests/resume_probe.py", str(recipe), threads=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def resumed_from(reference: Path, run_dir: Path) -> None:
    """``run_dir`` as a kill right after ``checkpoint-SAVE`` leaves it: that checkpoint, and what the ranks had
    recorded of the examples they trained on up to it."""
    shutil.copytree(reference / f"checkpoint-{SAVE}", run_dir / f"checkpoint-{SAVE}")
    for seen in reference.glob("seen-rank*.jsonl"):
        lines = [line for line in seen.read_text().splitlines() if json.loads(line)["step"] <= SAVE]
        (run_dir / seen.name).write_text("".join(line + "\n" for line in lines))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_llama_dir) -> dict:
    """Uninterrupted references on 2 ranks (accumulation 1) and on 1 process (accumulation 2), and each one's
    checkpoint-4 resumed on the other world size with the recipe's accumulation left as it was (the 1-process runs
    without a launcher: a 2-rank checkpoint resumed by a plain ``python -m hf_tune.run``)."""
    folder = tmp_path_factory.mktemp("world-size")
    out = {name: folder / name for name in ("two", "one", "two_to_one", "one_to_two")}
    torchrun(2, recipe_file(folder, tiny_llama_dir, out["two"], 1))
    one_process(recipe_file(folder, tiny_llama_dir, out["one"], 2))
    resumed_from(out["two"], out["two_to_one"])
    logs = {"two_to_one": one_process(recipe_file(folder, tiny_llama_dir, out["two_to_one"], 1)).stderr}
    resumed_from(out["one"], out["one_to_two"])
    logs["one_to_two"] = torchrun(2, recipe_file(folder, tiny_llama_dir, out["one_to_two"], 2)).stderr
    return {**out, "logs": logs}


def losses(run_dir: Path) -> list[float]:
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def seen_by_step(run_dir: Path) -> dict[int, list[str]]:
    steps: dict[int, list[str]] = {}
    for path in sorted(run_dir.glob("seen-rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["examples"])
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("name", ["two_to_one", "one_to_two"])
def test_a_resume_on_another_world_size_sees_each_example_once_per_epoch(runs, name):
    seen = seen_by_step(runs[name])
    assert sorted(seen) == list(range(1, STEPS + 1))
    assert all(len(examples) == 2 * BATCH for examples in seen.values())  # the global batch was kept
    per_epoch = ROWS // (2 * BATCH)
    first = [e for step in range(1, per_epoch + 1) for e in seen[step]]
    assert len(set(first)) == ROWS  # every example of the epoch, once
    second = [e for step in range(per_epoch + 1, STEPS + 1) for e in seen[step]]
    assert len(set(second)) == len(second) and set(second) <= set(first)  # the next epoch: none twice
    for reference in ("two", "one"):  # each step trained on the examples the uninterrupted runs' step did
        expected = seen_by_step(runs[reference])
        assert {s: sorted(e) for s, e in seen.items()} == {s: sorted(e) for s, e in expected.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "reference", "change"), [("two_to_one", "one", "1 -> 2"),
                                                            ("one_to_two", "two", "2 -> 1")])
def test_a_resume_on_another_world_size_ends_bit_identical_to_an_uninterrupted_run(runs, name, reference, change):
    """The tolerance, derived: zero. Each step's micro-batches are the same examples with the same padding on either
    world size, so each micro-batch's gradient g_i is computed by the same kernels on the same shapes (one CPU thread
    per rank). One rank accumulating 2 micro-batches stores g_0, then adds g_1: one rounding, g_0 + g_1. Two ranks
    all-reduce g_0 and g_1: gloo's sum of two tensors is the same single addition (addition commutes exactly);
    Trainer scales each rank's loss by the world size (average_tokens_across_devices) and DDP divides by it, both
    by 2, which is exact in float32. So the summed gradient, the clipped norm, the AdamW step, and the logged loss
    (the mean of two losses, each scaled by 2, vs their sum) are the same floats. With 3 or more ranks the
    all-reduce may add in another order than the accumulation and differ by a few ulps; this test has 2."""
    assert f"gradient_accumulation_steps {change} keeps the global batch of {2 * BATCH}" in runs["logs"][name]
    assert "rng_state_N.pth" in runs["logs"][name]  # the per-rank random states that cannot carry over: said
    assert losses(runs["two"]) == losses(runs["one"])  # the premise: both world sizes train the same floats
    assert len(losses(runs[name])) == STEPS and losses(runs[name]) == losses(runs[reference])
    mine, theirs = load_file(runs[name] / "model.safetensors"), load_file(runs[reference] / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    state = json.loads((runs[name] / f"checkpoint-{2 * SAVE}" / "trainer_state.json").read_text())
    recorded = state["stateful_callbacks"]["BatchShape"]["args"]  # what the next resume compares with
    world = 1 if name == "two_to_one" else 2
    assert recorded == {"world_size": world, "per_device_train_batch_size": BATCH,
                        "gradient_accumulation_steps": 2 // world}


def two_rank_checkpoint(run_dir: Path, zero: bool = False) -> Path:
    """A complete checkpoint as 2 ranks leave it (global batch 2 x 2 x 1 = 4): its recorded batch shape and one RNG
    file per rank; with ``zero``, DeepSpeed ZeRO's optimizer partitions (one per rank)."""
    from hf_tune.trainer.checkpoints import mark_complete
    from hf_tune.trainer.world_size import BatchShape

    checkpoint = run_dir / f"checkpoint-{SAVE}"
    checkpoint.mkdir(parents=True)
    state = {"global_step": SAVE, "stateful_callbacks": {"BatchShape": BatchShape(2, BATCH, 1).state()}}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    for rank in (0, 1):
        (checkpoint / f"rng_state_{rank}.pth").write_bytes(b"rng")
        if zero:
            (checkpoint / f"global_step{SAVE}").mkdir(exist_ok=True)
            partition = checkpoint / f"global_step{SAVE}" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            partition.write_bytes(b"z")
    mark_complete(checkpoint)
    return checkpoint


def refusal(raw: dict) -> str:
    from hf_tune import load_recipe, train
    from hf_tune.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        train(load_recipe(raw))
    assert not (Path(raw["training"]["output_dir"]) / "run.json").exists()  # refused before anything is written
    return f"{info.value.key} | {info.value}"


def test_a_global_batch_that_cannot_be_kept_on_one_rank_is_refused_with_the_keys(tmp_path, tiny_llama_dir):
    two_rank_checkpoint(tmp_path / "run")
    chosen = refusal(chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=9, per_device_train_batch_size=BATCH,
                                 gradient_accumulation_steps=3))  # the user chose 3: global 6, not 4
    assert chosen.startswith("training.gradient_accumulation_steps | ") and "global batch of 2 process(es)" in chosen
    assert "fix: training.gradient_accumulation_steps=2" in chosen and "ignore_data_skip=true" in chosen
    odd = refusal(chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=9, per_device_train_batch_size=3))
    assert "fix: choose training.per_device_train_batch_size and training.gradient_accumulation_steps whose " \
        "product with 1 process(es) is 4" in odd and "launch a number" not in odd  # 4 / 3: no process count helps


@pytest.mark.parametrize(("key", "setting"), [("data.streaming", {"data": {"streaming": True}}),
                                              ("training.train_sampling_strategy",
                                               {"training": {"train_sampling_strategy": "group_by_length"}})])
def test_an_order_that_depends_on_the_world_size_is_refused_on_another(tmp_path, tiny_llama_dir, key, setting):
    two_rank_checkpoint(tmp_path / "run")
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=9, per_device_train_batch_size=BATCH)
    for section, values in setting.items():
        raw[section].update(values)
    message = refusal(raw)
    assert message.startswith(f"{key} | ") and "trained on 2 process(es), this launch has 1" in message
    assert "fix: resume on 2 process(es)" in message


def test_zero_partitions_that_do_not_convert_stop_the_resume_with_the_converters_error(tmp_path, tiny_llama_dir):
    from hf_tune import load_recipe, train
    from hf_tune.errors import HfTuneError

    two_rank_checkpoint(tmp_path / "run", zero=True)  # partitions that are not DeepSpeed's files: the converter fails
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=9, per_device_train_batch_size=BATCH,
                      deepspeed="zero2")
    with pytest.raises(HfTuneError, match=r"(?s)^training.deepspeed: checkpoint-4 holds DeepSpeed ZeRO states of 2 "
                                          r"ranks, and converting them to a universal checkpoint failed:.*Error.*"
                                          r"fix: resume on 2 process\(es\)$"):
        train(load_recipe(raw))
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.slow
def test_a_zero2_checkpoint_of_two_ranks_resumes_on_one_from_a_universal_checkpoint(tmp_path, tiny_llama_dir):
    """ZeRO-2 on 2 CPU ranks, 4 steps; its checkpoint-2 resumed on 1 rank: converted to DeepSpeed's universal
    checkpoint on the way, the accumulation doubled. The tolerance is zero, as derived for DDP above: DeepSpeed's
    2-rank reduce-scatter adds the two ranks' gradients once, as accumulating two micro-batches does (checked: the
    same floats)."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    for run_dir in (reference, resumed):
        raw = yaml.safe_load(recipe_file(tmp_path, tiny_llama_dir, run_dir, 1).read_text())
        raw["training"].update(max_steps=4, save_steps=2, deepspeed="zero2")
        (tmp_path / f"{run_dir.name}.yaml").write_text(yaml.safe_dump(raw))
    torchrun(2, tmp_path / "reference.yaml")
    shutil.copytree(reference / "checkpoint-2", resumed / "checkpoint-2")
    log = torchrun(1, tmp_path / "resumed.yaml").stderr
    assert "Converting checkpoint-2/global_step2 to DeepSpeed's universal checkpoint" in log
    assert "gradient_accumulation_steps 1 -> 2 keeps the global batch of 4" in log
    assert (resumed / "checkpoint-2" / "latest_universal").read_text().strip() == "global_step2_universal"
    assert len(losses(resumed)) == 4 and losses(resumed) == losses(reference)
    assert json.loads((resumed / "run.json").read_text())["world_size"] == 1


def test_the_accumulation_is_set_for_the_checkpoints_global_batch_or_left_to_ignore_data_skip(tmp_path, tiny_llama_dir,
                                                                                              caplog):
    from hf_tune import load_recipe
    from hf_tune.trainer.world_size import fit_world_size
    from hf_tune.training_args import build_training_arguments

    checkpoint = two_rank_checkpoint(tmp_path / "run")
    recipe = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", per_device_train_batch_size=BATCH))
    fitted = fit_world_size(recipe, build_training_arguments(recipe), checkpoint)
    assert fitted.training["gradient_accumulation_steps"] == 2 and "gradient_accumulation_steps" not in recipe.training
    assert build_training_arguments(fitted).gradient_accumulation_steps == 2
    same = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", per_device_train_batch_size=4))  # 1 x 4 x 1
    assert fit_world_size(same, build_training_arguments(same), checkpoint) is same
    restart = load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", per_device_train_batch_size=3,
                                      ignore_data_skip=True))
    assert fit_world_size(restart, build_training_arguments(restart), checkpoint) is restart
    assert "ignore_data_skip is set, so the data order restarts" in caplog.text
