"""Real 2-process DDP on CPU (gloo) through torchrun and accelerate, and the launches that would silently not be
distributed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import launch
import pytest
import torch
import yaml
from conftest import REPO, chat_recipe, free_port
from runs import assert_data_parallel, run_ranks, small_recipe

BIN = Path(sys.executable).parent


@pytest.mark.slow
def test_torchrun_two_processes_train_one_model_on_different_batches(tmp_path, tiny_llama_dir):
    """With the chunked loss on (accelerate's launch below runs without it): the head's weight is read in the loss,
    outside the DDP-wrapped forward, and its gradient must still be averaged (tests/test_chunked_loss.py proves the
    loss itself)."""
    recipe = small_recipe(tmp_path, tiny_llama_dir)
    raw = yaml.safe_load(recipe.read_text())
    raw["model"]["chunked_loss"] = True
    recipe.write_text(yaml.safe_dump(raw))
    result = run_ranks(*launch.torchrun(2, "tests/ddp_probe.py", str(recipe)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_data_parallel(tmp_path / "run")  # identical parameters on both ranks, the tied head included


@pytest.mark.slow
def test_accelerate_multi_gpu_launch_on_cpu_is_data_parallel(tmp_path, tiny_llama_dir):
    recipe = small_recipe(tmp_path, tiny_llama_dir)
    result = run_ranks("accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port",
                       str(free_port()), "tests/ddp_probe.py", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_data_parallel(tmp_path / "run")


@pytest.mark.slow
def test_accelerate_single_process_launcher_asked_for_two_is_refused(tmp_path, tiny_llama_dir):
    recipe = small_recipe(tmp_path, tiny_llama_dir)
    result = run_ranks("accelerate", "launch", "--cpu", "--num_processes", "2", "-m", "hf_tune.run", str(recipe))
    assert result.returncode != 0  # hf_tune exits 2; accelerate reports it as 1
    assert "asked for 2 processes but started only this one" in result.stderr and "--multi_gpu" in result.stderr
    assert not (tmp_path / "run" / "trainer_state.json").exists()


@pytest.mark.slow
def test_torchrun_ranks_that_would_train_alone_are_refused(tmp_path, tiny_llama_dir):
    recipe = small_recipe(tmp_path, tiny_llama_dir, use_cpu=False)  # on CPU: each rank would be world size 1
    result = run_ranks("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "hf_tune.run",
                 str(recipe))
    assert result.returncode != 0
    assert "WORLD_SIZE=2" in result.stderr and "trains alone" in result.stderr


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_stops_every_rank_at_that_step(tmp_path, smol_tokenizer):
    """One poisoned example (its own tokens embed to NaN) reaches one rank only; rank 1 stopping alone would leave
    rank 0 stepping on the NaN gradients they shared, then waiting for it in the next collective."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = [json.loads(line) for line in (REPO / "examples" / "data" / "chat_demo.jsonl").read_text().splitlines()]
    rows = rows[:24]
    rows[5]["messages"][-1]["content"] += " Quokkas photobomb xylophonists."
    ids = [set(smol_tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
           for r in rows]
    poison = ids[5] - set().union(*ids[:5], *ids[6:])
    assert poison
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(smol_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=smol_tokenizer.pad_token_id,
                         eos_token_id=smol_tokenizer.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[sorted(poison)] = float("nan")
    model.save_pretrained(tmp_path / "model")
    smol_tokenizer.save_pretrained(tmp_path / "model")
    recipe = small_recipe(tmp_path, str(tmp_path / "model"), max_steps=12, save_strategy="steps", save_steps=1)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_ranks("torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "tests/ddp_probe.py",
                 str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [json.loads((tmp_path / "run" / f"rank{r}.json").read_text())["error"] for r in (0, 1)]
    steps = [int(e.split("the loss at step ", 1)[1].split()[0]) for e in errors]
    assert steps[0] == steps[1] and all("is not finite on rank(s) [" in e for e in errors), errors
    nan_ranks = errors[0].split("on rank(s) ", 1)[1].split(" (", 1)[0]
    assert nan_ranks in ("[0]", "[1]") and nan_ranks in errors[1], errors  # one rank's loss; both stopped
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*"))
    assert saved == list(range(1, steps[0])), saved  # nothing saved from the NaN step on


def test_fsdp_wrap_classes_are_checked_against_the_model_when_the_recipe_loads(tmp_path, tiny_llama_dir):
    from hf_tune import load_recipe
    from hf_tune.errors import HfTuneError

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", fsdp="full_shard auto_wrap",
                      fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayr"]})
    with pytest.raises(HfTuneError, match=r"(?s)transformer_layer_cls_to_wrap.*LlamaDecoderLayr.*LlamaForCausalLM"
                                          r".*did you mean 'LlamaDecoderLayer'"):
        load_recipe(raw)
    raw["training"]["fsdp_config"]["transformer_layer_cls_to_wrap"] = ["LlamaDecoderLayer"]
    assert load_recipe(raw).training["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]


def test_fsdp_on_cpu_is_refused_instead_of_silently_becoming_ddp(tmp_path, tiny_llama_dir):
    from hf_tune import load_recipe, train
    from hf_tune.errors import HfTuneError

    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", fsdp="full_shard auto_wrap")
    with pytest.raises(HfTuneError, match="(?s)training.fsdp is set but this run is on CPU.*ZeRO-3"):
        train(load_recipe(raw))


def test_the_shipped_fsdp2_accelerate_config_wraps_transformer_blocks():
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "examples" / "launch" / "fsdp2.yaml"))
    assert str(config.distributed_type).endswith("FSDP")
    assert config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_two_nodes_on_localhost_complete_a_zero3_run(tmp_path, tiny_llama_dir, launcher):
    """Each "node" is its own launcher process with its node rank, as on a cluster without ssh. Under torchrun a full
    fine-tune, whose model consolidates from the two nodes' shards; under the deepspeed launcher a LoRA run, whose
    saved adapter holds every trained tensor (TRL #4416 / PEFT #2892 report a ~40-byte empty adapter from ZeRO-3 +
    LoRA)."""

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = launcher == "deepspeed"
    recipe = small_recipe(tmp_path, tiny_llama_dir, deepspeed="zero3", **({"learning_rate": 1e-2} if lora else {}))
    if lora:
        raw = yaml.safe_load(recipe.read_text())
        raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
        recipe.write_text(yaml.safe_dump(raw))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = str(free_port())

    def node(rank: int) -> list[str]:
        if launcher == "torchrun":
            return ["torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
                    "--master_addr", "127.0.0.1", "--master_port", port, "-m", "hf_tune.run", str(recipe)]
        return ["deepspeed", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank),
                "--master_addr", "127.0.0.1", "--master_port", port, "--module", "hf_tune.run", str(recipe)]

    env = {"TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "hf_tune" / "torch_extensions")}
    nodes = [launch.start(*node(rank), env=env, threads=True, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "rank 0 of 2" in outputs[0] and "rank 1 of 2" in outputs[1]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["world_size"] == 2
    if not lora:
        AutoModelForCausalLM.from_pretrained(tmp_path / "run")  # consolidated from the two nodes' ZeRO-3 shards
        return
    adapter = load_file(tmp_path / "run" / "adapter_model.safetensors")
    config = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    assert len(adapter) == 2 * 2 * config["num_hidden_layers"]  # lora_A and lora_B of q_proj and v_proj per layer
    for name, tensor in adapter.items():
        assert tensor.numel() > 0 and tensor.shape[0 if "lora_A" in name else 1] == 4, name
    assert all(tensor.abs().sum() > 0 for name, tensor in adapter.items() if "lora_B" in name)  # B starts at 0


@pytest.mark.slow
def test_accelerate_launch_on_cpu_trains_on_every_core_unless_the_user_chose_a_thread_count(tmp_path, tiny_llama_dir):
    import os

    import psutil

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the user chose no thread count
    cores = min(psutil.cpu_count(logical=False) or 1, len(os.sched_getaffinity(0)))
    recipe = small_recipe(tmp_path, tiny_llama_dir, max_steps=1)
    for flags, expected in (([], cores), (["--num_cpu_threads_per_process", "1"], 1)):
        run_dir = tmp_path / f"run-{len(flags)}"
        result = launch.run("accelerate", "launch", *flags, "-m", "hf_tune.run", str(recipe),
                            f"training.output_dir={run_dir}", base_env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads((run_dir / "run.json").read_text())["cpu_threads"] == expected
        assert ("CPU threads:" in result.stderr) == (not flags)  # one log line, only when hf_tune chose


@pytest.mark.slow
def test_one_process_trains_the_same_weights_bit_for_bit_under_every_launcher(tmp_path, tiny_llama_dir):
    """python -m hf_tune.run, accelerate launch, torchrun --nproc_per_node 1 and the deepspeed launcher with one
    process, on the same machine and thread count (2, chosen: each launcher would otherwise pick its own): the same
    LoRA run with dropout ends on the same adapter and losses, and run.json names the launcher."""
    from safetensors.torch import load_file

    recipe = small_recipe(tmp_path, tiny_llama_dir, seed=5, learning_rate=1e-2)
    raw = yaml.safe_load(recipe.read_text())
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1}  # draws every step
    recipe.write_text(yaml.safe_dump(raw))
    port = str(free_port())
    commands = {
        "python": ["python", "-m", "hf_tune.run"],
        "accelerate": ["accelerate", "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                       "--dynamo_backend", "no", "--num_cpu_threads_per_process", "2", "-m", "hf_tune.run"],
        "torchrun": ["torchrun", "--nproc_per_node", "1", "--master_port", port, "-m", "hf_tune.run"],
        "deepspeed": ["deepspeed", "--num_gpus", "1", "--master_port", port, "--module", "hf_tune.run"],
    }
    env = {"OMP_NUM_THREADS": "2", "TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "hf_tune" / "torch_extensions")}
    adapters, losses, manifests = {}, {}, {}
    for name, command in commands.items():
        run_dir = tmp_path / name
        done = launch.run(*command, str(recipe), f"training.output_dir={run_dir}", env=env)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        adapters[name] = load_file(run_dir / "adapter_model.safetensors")
        losses[name] = [row["loss"] for row in json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
                        if "loss" in row]
        manifests[name] = json.loads((run_dir / "run.json").read_text())
    assert {name: m["numerics"]["launcher"] for name, m in manifests.items()} == {name: name for name in commands}
    assert {m["cpu_threads"] for m in manifests.values()} == {2} and {m["world_size"] for m in manifests.values()} == {1}
    reference = adapters["python"]
    for name in commands:
        assert losses[name] == losses["python"] and len(losses[name]) == 3, name
        assert all(torch.equal(adapters[name][key], reference[key]) for key in reference), name
