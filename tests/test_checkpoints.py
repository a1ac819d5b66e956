"""Crash safety: runs killed with SIGKILL (between checkpoints, twice, with a half-written checkpoint) resume and end
bit-identical to an uninterrupted run; seeds; the NaN guard; resume modes; manifest; trackers; report."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import launch
import pytest
import yaml
from conftest import chat_recipe, free_port, nan_model
from runs import assert_same_run, crash_recipe, kill_after_checkpoint, run_to_end, step_losses, wait_for

from hf_tune import load_recipe, train
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.trainer.checkpoints import MARKER, is_complete

SECRET = "hf_SECRETtoken1234567890abcdefghijklmnop"  # the shape of a real token: hf_ and 34 characters


@pytest.fixture
def uninterrupted(references, tiny_llama_dir) -> Path:
    """The crash recipe run to its end without a kill: the session's shared reference."""
    return references.run(crash_recipe(tiny_llama_dir, Path("reference")))


@pytest.mark.slow
def test_killed_twice_then_a_half_written_checkpoint_is_ignored_and_w_and_b_keeps_one_run(tmp_path, tiny_llama_dir,
                                                                                       uninterrupted):
    """Killed (SIGKILL) after checkpoint 3 and again after checkpoint 6, a half-written checkpoint-9 planted: the same
    command resumes from checkpoint-6 and ends bit-identical to the uninterrupted run. The run logs to W&B with no API
    key (offline, one run id across the three launches) and to TensorBoard: trackers change no step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")  # no API key anywhere
    run_dir = tmp_path / "run"
    raw = crash_recipe(tiny_llama_dir, run_dir, report_to=["wandb", "tensorboard"])
    raw["tracking"] = {"project": "hf-tune-tests", "name": "offline", "tags": ["ci"]}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    kill_after_checkpoint(recipe, run_dir, 3, base_env=env)
    kill_after_checkpoint(recipe, run_dir, 6, base_env=env)
    assert not (run_dir / "model.safetensors").exists()
    # What a kill in the middle of Trainer's save leaves: a newer checkpoint folder, some files short, no marker.
    partial = run_dir / "checkpoint-9"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(run_dir / "checkpoint-6", partial)
    (partial / MARKER).unlink()
    with open(partial / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    assert not is_complete(partial)
    result = run_to_end(recipe, base_env=env)  # the same command again
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Ignoring" in result.stderr and "checkpoint-6" in result.stderr.split("Resuming from", 1)[1][:300]
    assert_same_run(run_dir, uninterrupted)
    assert "logs offline" in result.stderr and "wandb sync" in result.stderr
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 3 and all(p.name.endswith(run_id) for p in offline)  # the three launches logged one run
    assert list(run_dir.rglob("events.out.tfevents.*"))


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_which_resumes(tmp_path, tiny_llama_dir, uninterrupted):
    import psutil

    run_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(crash_recipe(tiny_llama_dir, run_dir)))
    proc = launch.start("torchrun", "--nproc_per_node", "1", "--max-restarts", "1", "--master_port", str(free_port()),
                        "-m", "hf_tune.run", str(recipe))
    wait_for(lambda: is_complete(run_dir / "checkpoint-6"), proc)
    workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "hf_tune.run" in " ".join(c.cmdline())]
    assert len(workers) == 1
    workers[0].send_signal(signal.SIGKILL)  # the worker dies; the torchrun agent stays
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "Resuming from" in err
    assert_same_run(run_dir, uninterrupted)


def test_same_seed_same_losses_other_seed_other_losses(tmp_path, tiny_llama_dir):
    def losses(name, seed):
        raw = chat_recipe(tiny_llama_dir, tmp_path / name, max_steps=5, seed=seed, learning_rate=5e-3)
        train(load_recipe(raw))
        return [loss for _, loss in step_losses(tmp_path / name)]

    first, again, other = losses("a", 11), losses("b", 11), losses("c", 12)
    assert first == again
    assert first != other


def test_a_planted_nan_stops_the_run_with_the_step_and_last_checkpoint(tmp_path, tiny_llama_dir):
    broken = nan_model(tiny_llama_dir, tmp_path / "nan-model")
    with pytest.raises(HfTuneError, match=r"(?s)loss at step 1 is nan.*last good checkpoint: none yet"):
        train(load_recipe(chat_recipe(broken, tmp_path / "run")))


def test_resume_modes(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", save_strategy="steps", save_steps=1)
    train(load_recipe(raw))
    with pytest.raises(HfTuneError, match="training.output_dir: .* holds a finished run"):
        train(load_recipe(raw))
    raw_never = chat_recipe(tiny_llama_dir, tmp_path / "run", resume_from_checkpoint=False)
    assert load_recipe(raw_never).training["resume_from_checkpoint"] == "never"
    (tmp_path / "run" / "run.json").unlink()  # no longer finished, but not empty
    with pytest.raises(HfTuneError, match="resume_from_checkpoint: is 'never'"):
        train(load_recipe(raw_never))
    (tmp_path / "run" / "checkpoint-1" / MARKER).unlink()
    with pytest.raises(HfTuneError, match="not a complete hf_tune checkpoint"):
        train(load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run",
                                      resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))))


def test_a_token_in_the_recipe_is_refused_before_anything_is_written(tmp_path, tiny_llama_dir):
    for training, key in (({"hub_token": SECRET}, "training.hub_token"),
                          ({"run_name": f"run-{SECRET}"}, "training.run_name")):
        with pytest.raises(RecipeError, match="HF_TOKEN") as info:
            load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run", **training))
        assert info.value.key == key and SECRET not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_manifest_has_every_field_and_no_secret(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)  # where a token belongs: the environment (or `hf auth login`)
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", save_strategy="steps", save_steps=1)
    raw["data"]["eval_split"] = 0.05
    train(load_recipe(raw))
    text = (tmp_path / "run" / "run.json").read_text()
    manifest = json.loads(text)
    assert {"recipe", "packages", "git", "host", "world_size", "device", "datasets", "start_time", "end_time",
            "metrics", "command"} <= manifest.keys()
    assert {"python", "torch", "transformers", "datasets", "accelerate", "peft", "deepspeed", "optuna"} <= \
        manifest["packages"].keys()
    assert manifest["git"]["commit"] and isinstance(manifest["git"]["dirty"], bool)
    assert manifest["datasets"]["train"]["fingerprint"] and manifest["datasets"]["eval"]["examples"] > 0
    assert manifest["world_size"] == 1 and manifest["device"] == "cpu"
    assert "train_loss" in manifest["metrics"] and "eval_loss" in manifest["metrics"]
    assert manifest["end_time"] >= manifest["start_time"]
    assert manifest["cpu_threads"] >= 1
    # what ran is what plan showed: one set of decisions (hf_tune/assembly/decisions.py), read off the built run
    from hf_tune.workflows.plan import plan

    assert manifest["decisions"] == plan(load_recipe(raw), out_dir=tmp_path / "plan")["decisions"]
    assert manifest["decisions"]["attention"] == "sdpa_varlen" and manifest["decisions"]["padding_free"]
    files = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert any(path.name == "training_args.bin" for path in files)  # Trainer's pickled arguments, in each checkpoint
    for path in files:  # every byte of the run folder and its checkpoints
        assert SECRET.encode() not in path.read_bytes(), path


def test_training_report_plots(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=4, eval_strategy="steps", eval_steps=2)
    raw["data"]["eval_split"] = 0.05
    train(load_recipe(raw))
    for name in ("loss.png", "lr.png"):
        assert (tmp_path / "run" / name).stat().st_size > 5_000
    result = launch.run("hf-tune", "report", str(tmp_path / "run"), timeout=300)
    assert result.returncode == 0 and "loss.png" in result.stdout


def test_report_of_a_run_in_progress_draws_from_its_newest_complete_checkpoint(tmp_path, tiny_llama_dir):
    from hf_tune.records.report import write_report

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=4, save_strategy="steps", save_steps=2)
    train(load_recipe(raw))
    run = tmp_path / "run"
    for name in ("trainer_state.json", "loss.png", "lr.png", "run.json"):  # as it is before the run ends
        (run / name).unlink()
    (run / "checkpoint-4" / MARKER).unlink()  # the newest checkpoint is cut off mid-save: checkpoint-2 is read
    written = write_report(run)
    assert run / "loss.png" in written and (run / "loss.png").stat().st_size > 5_000
    assert not list((run / "checkpoint-2").glob("*.png"))  # the plots land in the run folder, not the checkpoint


def _resume_on_rank(rank: int, port: int, output_dirs: list[str], results) -> None:
    import torch.distributed as dist

    from hf_tune.trainer.checkpoints import resume_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results.put((rank, "resumes", resume_checkpoint(Path(output_dirs[rank]), "auto")))
    except Exception as err:  # noqa: BLE001 - reported to the test
        results.put((rank, type(err).__name__, str(err)))
    finally:
        dist.destroy_process_group()


def resume_on_two_ranks(output_dirs: list[Path], port: int) -> dict:
    """What each of two gloo processes resumes from, each looking at its own view of the run folder."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_resume_on_rank, args=(r, port, [str(d) for d in output_dirs], results))
             for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(120)
    assert [process.exitcode for process in ranks] == [0, 0]  # none hung or crashed
    return {rank: (kind, value) for rank, kind, value in (results.get(timeout=5) for _ in ranks)}


def fake_checkpoint(run_dir: Path, step: int) -> None:
    (run_dir / f"checkpoint-{step}").mkdir(parents=True)
    (run_dir / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    from hf_tune.trainer.checkpoints import mark_complete

    mark_complete(run_dir / f"checkpoint-{step}")


def test_ranks_resume_from_the_checkpoint_the_main_process_chose(tmp_path):
    """Each rank looking for itself could pick another checkpoint (a stale NFS view, node-local disks) and train
    from another step; the main process decides and every rank must see its choice."""
    shared, stale = tmp_path / "shared", tmp_path / "stale"
    for step in (2, 4):
        fake_checkpoint(shared, step)
    fake_checkpoint(stale, 2)  # what rank 1 sees: checkpoint-4 not (yet) there
    answers = resume_on_two_ranks([shared, shared], port=free_port())
    assert answers == {0: ("resumes", str(shared / "checkpoint-4")), 1: ("resumes", str(shared / "checkpoint-4"))}

    answers = resume_on_two_ranks([shared, stale], port=free_port())
    for rank in (0, 1):
        kind, message = answers[rank]
        assert kind == "HfTuneError" and "resumes from checkpoint-4, but rank(s) [1] do not see it complete" in \
            message, message
        assert "save_on_each_node" in message
    (stale / "checkpoint-4").mkdir()  # there, but cut off while saving (no marker): not good enough either
    (stale / "checkpoint-4" / "trainer_state.json").write_text("{}")
    answers = resume_on_two_ranks([shared, stale], port=free_port())
    assert all("rank(s) [1] do not see it complete" in answers[rank][1] for rank in (0, 1)), answers

    (shared / "run.json").write_text(json.dumps({"end_time": "2026-11-23T10:00:00"}))
    answers = resume_on_two_ranks([shared, stale], port=free_port())  # rank 1 alone would resume checkpoint-2
    assert answers[0] == answers[1] and answers[0][0] == "RecipeError", answers
    assert "holds a finished run" in answers[1][1] and "fix: choose a new training.output_dir" in answers[1][1]

    (shared / "run.json").unlink()
    (shared / "run.json").mkdir()  # an error that is not hf_tune's: rank 0 raises it, rank 1 is told
    answers = resume_on_two_ranks([shared, stale], port=free_port())
    assert answers[0][0] == "IsADirectoryError", answers
    assert answers[1][0] == "HfTuneError" and "on the main process: IsADirectoryError" in answers[1][1], answers


def test_a_resume_with_a_changed_learning_rate_trains_with_the_recipes(tmp_path, tiny_llama_dir):
    """Run A trains 4 steps at 1e-3 (constant schedule, layer-wise decay 0.5, weight decay 0.01), saving at step 2.
    Run B continues from A's checkpoint-2 with learning_rate 2e-4 and weight_decay 0.1. Loading the checkpoint
    restores A's groups; B must train with its own recipe's: peaks 2e-4 x 0.5^k over the depths (embeddings,
    2 blocks, final norm and tied head), as written out here, and weight decay 0.1 on the decayed groups."""
    def recipe(name: str, **training):
        raw = chat_recipe(tiny_llama_dir, tmp_path / name, **{
            "max_steps": 4, "save_strategy": "steps", "save_steps": 2, "lr_scheduler_type": "constant",
            "warmup_steps": 0, "weight_decay": 0.01, **training})
        raw["optim"] = {"layerwise_lr_decay": 0.5}
        return load_recipe(raw)

    a = train(recipe("a"))
    b = train(recipe("b", learning_rate=2e-4, weight_decay=0.1,
                     resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")))
    depths = 4  # embeddings, block 0, block 1, the top (final norm; the head is tied to the embeddings)
    for trainer, peak, decay in ((a, 1e-3, 0.01), (b, 2e-4, 0.1)):
        groups = trainer.optimizer.param_groups
        assert {round(g["lr"] / peak, 12) for g in groups} == {0.5 ** k for k in range(depths)}
        assert {g["weight_decay"] for g in groups} == {0.0, decay}
    logged = [log["learning_rate"] for log in b.state.log_history if "loss" in log]
    assert logged[:2] == [a.state.log_history[0]["learning_rate"]] * 2  # A's steps 1-2, from the checkpoint
    assert [round(lr / 2e-4, 12) for lr in logged[2:]] == [round(logged[0] / 1e-3, 12)] * 2  # B's own 3-4


def test_a_resume_whose_optimizer_groups_changed_is_refused_with_the_keys(tmp_path, tiny_llama_dir):
    """weight_decay 0.01 -> 0 merges each depth's decay and no-decay groups: the checkpoint's optimizer state cannot
    line up with the recipe's groups, and the error names the keys instead of torch's message alone."""
    raw = chat_recipe(tiny_llama_dir, tmp_path / "a", max_steps=2, save_strategy="steps", save_steps=2)
    raw["training"]["weight_decay"] = 0.01
    train(load_recipe(raw))
    raw = chat_recipe(tiny_llama_dir, tmp_path / "b", max_steps=4, weight_decay=0.0,
                      resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    with pytest.raises(HfTuneError, match=r"(?s)^training.resume_from_checkpoint: .*parameter groups.*fix: .*"
                                          r"weight_decay zero or not"):
        train(load_recipe(raw))
