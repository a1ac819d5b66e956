"""The resilience section: checkpoints mirrored to a local S3 stand-in (moto's server, over HTTP) and restored from it
on a fresh machine; a rollback past a NaN instead of a stop."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import launch
import pytest
import torch
import yaml
from conftest import DATA, chat_recipe, free_port
from runs import assert_same_run, crash_recipe, run_to_end, wait_for
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_tune import load_recipe, train
from hf_tune.errors import EXIT_DIVERGED, RecipeError
from hf_tune.trainer.checkpoints import MARKER, mark_complete
from hf_tune.trainer.mirror import open_mirror, remote_checkpoints, remote_is_complete, restore_from_mirror

POISON = " xylophone"  # its first token is in none of the demo chats used here


@pytest.fixture(scope="session")
def s3_stand_in():
    """moto's S3 server on 127.0.0.1, once per session; the AWS_* variables point every process at it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    variables = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    import boto3

    boto3.client("s3").create_bucket(Bucket="ckpts")
    yield "s3://ckpts"
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


def test_a_mirror_url_with_credentials_is_refused_without_echoing_them(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run")
    raw["resilience"] = {"checkpoint_mirror": "s3://AKIAEXAMPLE:wJalrXUtnFEMIsecret@ckpts/run"}
    with pytest.raises(RecipeError, match="AWS_ACCESS_KEY_ID") as info:
        load_recipe(raw)
    assert info.value.key == "resilience.checkpoint_mirror" and "wJalr" not in str(info.value)
    raw["resilience"] = {"rollback_on_nonfinit": 1}
    with pytest.raises(RecipeError, match="did you mean 'rollback_on_nonfinite'"):
        load_recipe(raw)
    raw["resilience"] = {"rollback_on_nonfinite": 1}
    raw["training"]["deepspeed"] = "zero2"
    with pytest.raises(RecipeError, match="^resilience.rollback_on_nonfinite: is not supported under DeepSpeed"):
        load_recipe(raw)
    del raw["training"]["deepspeed"]
    with pytest.raises(RecipeError, match="^resilience.rollback_on_nonfinite: rolls back to the last complete "
                       "checkpoint, and training.save_strategy 'no' keeps none"):
        load_recipe(raw)  # chat_recipe saves no checkpoint
    raw["training"].update(save_strategy="steps", save_steps=2)
    assert load_recipe(raw).to_dict()["resilience"] == {"rollback_on_nonfinite": 1}
    raw.pop("resilience")
    assert "resilience" not in load_recipe(raw).to_dict()  # recipe.yaml keeps the section only when it is used


def test_only_a_completely_uploaded_mirror_checkpoint_is_restored(tmp_path, s3_stand_in):
    url = f"{s3_stand_in}/unit"
    fs, root = open_mirror(url)
    local = tmp_path / "written"
    for step in (2, 4, 6):
        (local / f"checkpoint-{step}").mkdir(parents=True)
        (local / f"checkpoint-{step}" / "model.safetensors").write_bytes(os.urandom(1000 + step))
        (local / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        mark_complete(local / f"checkpoint-{step}")
        fs.put(str(local / f"checkpoint-{step}"), f"{root}/", recursive=True)
    (local / "run.json").write_text("{}")
    fs.put_file(str(local / "run.json"), f"{root}/run.json")
    fs.rm_file(f"{root}/checkpoint-6/{MARKER}")  # cut off before its marker
    fs.pipe_file(f"{root}/checkpoint-4/model.safetensors", b"short")  # a file not the size its marker says
    assert sorted(remote_checkpoints(fs, root)) == [2, 4, 6]
    assert [remote_is_complete(fs, f"{root}/checkpoint-{s}") for s in (2, 4, 6)] == [True, False, False]

    fresh = tmp_path / "fresh"
    assert restore_from_mirror(fresh, url) == fresh / "checkpoint-2"
    assert (fresh / "checkpoint-2" / "model.safetensors").read_bytes() == \
        (local / "checkpoint-2" / "model.safetensors").read_bytes()
    assert (fresh / "run.json").read_text() == "{}" and not (fresh / "checkpoint-4").exists()
    assert restore_from_mirror(fresh, url) is None  # a folder with a complete checkpoint keeps its own


@pytest.fixture
def uninterrupted(references, tiny_llama_dir) -> Path:
    """The crash recipe run to its end without a kill: the session's shared reference (test_checkpoints' too)."""
    return references.run(crash_recipe(tiny_llama_dir, Path("reference")))


def test_a_checkpoint_mirrored_to_a_shared_folder_comes_back_whole_after_trainer_rotated_it_away(tmp_path):
    from types import SimpleNamespace

    from hf_tune.trainer.mirror import CheckpointMirror

    out, url = tmp_path / "run", f"file://{tmp_path}/shared/mirror"
    checkpoint = out / "checkpoint-3"
    (checkpoint / "nested").mkdir(parents=True)
    (checkpoint / "nested" / "weights.bin").write_bytes(os.urandom(5000))
    (checkpoint / "trainer_state.json").write_text("{}")
    mark_complete(checkpoint)
    (out / "recipe.yaml").write_text("model: {}\n")
    expected = {p.relative_to(checkpoint): p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    mirror = CheckpointMirror(url)
    mirror.on_save(SimpleNamespace(output_dir=str(out), save_total_limit=None),
                   SimpleNamespace(global_step=3, is_world_process_zero=True, is_hyper_param_search=False), None)
    shutil.rmtree(checkpoint)  # Trainer's rotation may delete it while the upload runs: the upload has its own links
    mirror.wait()
    assert not mirror.failed and not (out / ".mirror_upload" / "checkpoint-3").exists()
    fresh = tmp_path / "fresh"
    assert restore_from_mirror(fresh, url) == fresh / "checkpoint-3"
    assert {p.relative_to(fresh / "checkpoint-3"): p.read_bytes() for p in (fresh / "checkpoint-3").rglob("*")
            if p.is_file()} == expected
    assert (fresh / "recipe.yaml").read_text() == "model: {}\n"


@pytest.mark.slow
def test_killed_run_whose_folder_is_lost_resumes_from_the_s3_mirror(tmp_path, tiny_llama_dir, uninterrupted,
                                                                     s3_stand_in):
    url = f"{s3_stand_in}/killed"
    run_dir = tmp_path / "run"
    raw = crash_recipe(tiny_llama_dir, run_dir, save_total_limit=2)
    raw["resilience"] = {"checkpoint_mirror": url}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    fs, root = open_mirror(url)
    proc = launch.start("python", "-m", "hf_tune.run", str(recipe))
    wait_for(lambda: remote_is_complete(fs, f"{root}/checkpoint-3"), proc)  # the first: uploads lag the steps
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    shutil.rmtree(run_dir)  # the machine is gone, with its disk
    result = run_to_end(recipe)
    assert result.returncode == 0, result.stderr[-3000:]
    restored = re.search(r"Downloaded checkpoint-(\d+) from the checkpoint mirror", result.stderr)
    assert restored and int(restored.group(1)) >= 3, result.stderr[-3000:]
    assert_same_run(run_dir, uninterrupted)
    # the mirror keeps what save_total_limit kept locally, every one complete, and the finished run's files
    local = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    assert local == ["checkpoint-12", "checkpoint-9"]  # sorted by name
    assert sorted(f"checkpoint-{s}" for s in remote_checkpoints(fs, root)) == local
    assert all(remote_is_complete(fs, f"{root}/{name}") for name in local)
    assert json.loads(fs.cat_file(f"{root}/run.json"))["end_time"]


def poisoned_model(tokenizer, folder: Path, token: int) -> str:
    """A random 2-layer Llama (untied head) whose input embedding of ``token`` is NaN: a batch holding that token
    has a NaN loss, every other batch a finite one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[token] = float("nan")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, smol_tokenizer):
    """(model folder, data file): 40 demo chats and one that holds the poisoned token."""
    folder = tmp_path_factory.mktemp("poisoned")
    chats = [json.loads(line) for line in (DATA / "chat_demo.jsonl").read_text().splitlines()[:40]]
    bad = {"messages": [{"role": "user", "content": "Which instrument do you play?"},
                        {"role": "assistant", "content": f"I play the{POISON}."}]}
    chats.insert(17, bad)
    token = smol_tokenizer(POISON)["input_ids"][0]
    ids = [smol_tokenizer.apply_chat_template(c["messages"], tokenize=True, return_dict=True)["input_ids"]
           for c in chats]
    assert [token in i for i in ids].count(True) == 1 and token in ids[17]
    (folder / "data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return poisoned_model(smol_tokenizer, folder / "model", token), folder / "data.jsonl"


def poisoned_recipe(poisoned, out: Path, rollbacks: int) -> dict:
    model, data = poisoned
    # seed 8 puts the poisoned chat in step 6; 41 chats make 11 steps an epoch, so 10 steps meet it once
    raw = chat_recipe(model, out, max_steps=10, per_device_train_batch_size=4, save_strategy="steps",
                      save_steps=2, seed=8)
    raw["data"]["train"] = {"path": str(data)}
    raw["resilience"] = {"rollback_on_nonfinite": rollbacks}
    return raw


@pytest.fixture(scope="module")
def nan_step(poisoned, tmp_path_factory) -> tuple[int, Path]:
    """(the step whose batch holds the poisoned chat, the run folder), from a run without rollback: it stops with
    exit status 3."""
    folder = tmp_path_factory.mktemp("off")
    recipe = folder / "r.yaml"
    recipe.write_text(yaml.safe_dump(poisoned_recipe(poisoned, folder / "run", rollbacks=0)))
    result = launch.run("python", "-m", "hf_tune.run", str(recipe))
    assert result.returncode == EXIT_DIVERGED, result.stderr[-3000:]
    step = int(re.search(r"the loss at step (\d+) is nan", result.stderr).group(1))
    assert 2 < step <= 10  # after the first checkpoint, within the run
    return step, folder / "run"


@pytest.mark.slow
def test_a_nan_step_is_rolled_back_and_skipped(tmp_path, poisoned, nan_step):
    nan_step, stopped = nan_step
    trainer = train(load_recipe(poisoned_recipe(poisoned, tmp_path / "run", rollbacks=1)))
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    reloaded = (nan_step - 1) // 2 * 2  # the last checkpoint before the NaN (saved every 2 steps)
    assert len(manifest["rollbacks"]) == 1
    rollback = manifest["rollbacks"][0]
    assert rollback["step"] == nan_step and rollback["checkpoint"] == f"checkpoint-{reloaded}"
    assert [(b["step"], b["micro_batch"], b["sequences"]) for b in rollback["skipped_batches"]] == [(nan_step, 0, 4)]
    losses = {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}
    assert sorted(losses) == list(range(1, 11)) and trainer.state.global_step == 10
    assert all(math.isfinite(loss) for loss in losses.values())
    before = json.loads((stopped / f"checkpoint-{reloaded}" / "trainer_state.json").read_text())["log_history"]
    assert [losses[log["step"]] for log in before if "loss" in log] == [log["loss"] for log in before if "loss" in log]
    assert losses[nan_step] == 0.0  # the skipped step: no batch trained, Trainer logs its zero loss
    assert math.isfinite(manifest["metrics"]["train_loss"]) and manifest["end_time"]


class PoisonedGradient(TrainerCallback):
    """Makes one parameter's gradient NaN in the backward pass of optimizer step ``step``, the first time only: the
    loss stays finite."""

    def __init__(self, step: int):
        self.step, self.fired = step, False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not getattr(self, "hooked", False):
            self.hooked = True
            weight = model.get_input_embeddings().weight
            weight.register_hook(lambda grad: self.poison(grad, state))

    def poison(self, grad, state):
        if state.global_step + 1 == self.step and not self.fired:
            self.fired = True
            return grad * float("nan")
        return grad


def test_a_nan_gradient_under_a_finite_loss_is_rolled_back_and_its_step_changes_nothing(tmp_path, tiny_llama_dir):
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=6, save_strategy="steps", save_steps=1,
                      max_grad_norm=0.0)  # no clipping: the NaN reaches the optimizer unchanged
    raw["resilience"] = {"rollback_on_nonfinite": 1}
    poison = PoisonedGradient(step=5)
    trainer = train(load_recipe(raw), callbacks=[poison])
    assert poison.fired
    rollback, = json.loads((tmp_path / "run" / "run.json").read_text())["rollbacks"]
    assert rollback["step"] == 5 and rollback["checkpoint"] == "checkpoint-4"
    assert [b["step"] for b in rollback["skipped_batches"]] == [5]
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)
    # the skipped step left the weights and Adam's moments and step counts exactly as checkpoint-4 had them
    before, after = (tmp_path / "run" / "checkpoint-4", tmp_path / "run" / "checkpoint-5")
    weights = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    moments = [torch.load(c / "optimizer.pt", weights_only=True)["state"] for c in (before, after)]
    assert moments[0].keys() == moments[1].keys() and all(
        torch.equal(moments[0][i][name], moments[1][i][name]) for i in moments[0] for name in moments[0][i])
    final = load_file(tmp_path / "run" / "model.safetensors")
    assert not torch.equal(final["model.norm.weight"], weights[1]["model.norm.weight"])  # step 6 trained
