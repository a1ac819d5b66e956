"""Every verb's numeric options are checked as strictly as a recipe (hf_tune/commands/option_types.py): a value out of
range ends in one error naming the flag and what it takes, exit status 2, no traceback, nothing written; a GPU memory
given in MiB is named as such with the figure in GB."""

from __future__ import annotations

import pytest

from hf_tune.commands.cli import main

CASES = [  # argv, the message's key part
    (["init", "Qwen/Qwen3-8B", "--gpus", "0"], "argument --gpus: must be from 1 to 4096, got 0"),
    (["init", "Qwen/Qwen3-8B", "--gpus", "-2"], "argument --gpus: must be from 1 to 4096, got -2"),
    (["init", "Qwen/Qwen3-8B", "--gpus", "two"], "argument --gpus: must be a whole number, got 'two'"),
    (["init", "Qwen/Qwen3-8B", "--gpu-memory", "81920"],
     "argument --gpu-memory: 81920 GB is more than any GPU holds; if that is MiB, it is 80 GB: --gpu-memory 80"),
    (["init", "Qwen/Qwen3-8B", "--gpu-memory", "0"], "argument --gpu-memory: must be above 0, got 0"),
    (["init", "Qwen/Qwen3-8B", "--gpu-memory", "nan"], "argument --gpu-memory: must be above 0, got nan"),
    (["init", "Qwen/Qwen3-8B", "--max-length", "0"], "argument --max-length: must be 1 or more, got 0"),
    (["plan", "recipe.yaml", "--world-size", "-4"], "argument --world-size: must be 1 or more, got -4"),
    (["cv", "recipe.yaml", "--folds", "1"], "argument --folds: must be 2 or more, got 1"),
    (["eval", "runs/x", "--interval", "0"], "argument --interval: must be above 0, got 0"),
    (["eval", "runs/x", "--limit", "-1"], "argument --limit: must be above 0, got -1"),
    (["eval", "runs/x", "--watch", "--wait", "-5"], "argument --wait: must be at least 0, got -5"),
    (["eval", "runs/x", "--checkpoint", "-3"], "argument --checkpoint: must be 0 or more, got -3"),
    (["chat", "runs/x", "--top-p", "1.5"], "argument --top-p: must be above 0 and at most 1, got 1.5"),
    (["chat", "runs/x", "--temperature", "-1"], "argument --temperature: must be at least 0, got -1"),
    (["chat", "runs/x", "--max-new-tokens", "0"], "argument --max-new-tokens: must be 1 or more, got 0"),
    (["generate", "runs/x", "--input", "p.jsonl", "--out", "a.jsonl", "--batch-size", "0"],
     "argument --batch-size: must be 1 or more, got 0"),
    (["generate", "runs/x", "--input", "p.jsonl", "--out", "a.jsonl", "--top-p", "0"],
     "argument --top-p: must be above 0 and at most 1, got 0"),
    (["serve", "runs/x", "--port", "70000"], "argument --port: must be from 1 to 65535, got 70000"),
    (["export", "runs/x", "--quant", "q4_k"], "argument --quant: invalid choice: 'q4_k'"),
    (["reproduce", "runs/x", "--out", "a", "--against", "b"], "--out and --against: give one"),
    (["serve", "runs/x", "--device", "cuda:99"], "argument --device: cuda:99: this machine has"),
    (["generate", "runs/x", "--input", "p.jsonl", "--out", "a.jsonl", "--device", "gpu"],
     "argument --device: 'gpu' is not a torch device"),
    (["chat", "runs/x", "--device", "cuda:99"], "argument --device: cuda:99: this machine has"),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(argv[2:]) for argv, _ in CASES])
def test_an_option_out_of_range_is_one_named_error_with_nothing_written(argv, message, tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and message in err, err
    assert "Traceback" not in err and err.count("error:") == 1
    assert not list(tmp_path.iterdir())  # no recipe, no run folder


def test_init_on_a_model_it_cannot_write_a_chat_recipe_for_names_it(tmp_path, monkeypatch, capsys):
    """A folder without a config, an image model, an encoder: one error naming the model and what init writes."""
    from transformers import BertConfig, ViTConfig

    (tmp_path / "empty").mkdir()
    ViTConfig().save_pretrained(tmp_path / "vit")
    BertConfig(architectures=["BertModel"]).save_pretrained(tmp_path / "encoder")
    monkeypatch.chdir(tmp_path)
    for folder, said in (("empty", "no model config to read"), ("vit", "a vit model, not a causal LM"),
                         ("encoder", "a bert model (BertModel), not a causal LM")):
        before = sorted(tmp_path.rglob("*"))
        with pytest.raises(SystemExit) as stopped:
            main(["init", str(tmp_path / folder), "--gpus", "1", "--gpu-memory", "24"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and said in err and "Traceback" not in err, err
        assert err.count("error:") == 1 and "fix: " in err, err
        assert folder == "empty" or "fix: start from recipes/cls_llrd.yaml" in err, err
        assert sorted(tmp_path.rglob("*")) == before  # no recipe written
