"""The reference log-probability cache (hf_tune/trainer/reference.py): keyed on the base's identity, not its local tensors,
so that under 2-process DeepSpeed ZeRO-3 on CPU two bases of one architecture never share an entry."""

from __future__ import annotations

import json
import os

import launch
import pytest
import yaml
from conftest import REPO, chat_recipe, save_tiny_llama
from inputs import conversational_pairs, method_recipe


def chosen_logps(base: str, rows: list[dict]) -> list[float]:
    """Sum of log p(chosen token | everything before it) over each chosen completion, computed here with the base."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    sums = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["chosen_ids"]])
            logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            per_token = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            sums.append(per_token[len(row["prompt_ids"]) - 1:].sum().item())
    return sums


@pytest.mark.slow
def test_two_bases_of_one_architecture_never_share_an_entry_under_zero3(tmp_path, smol_tokenizer):
    """One 2-process ZeRO-3 launch builds the DPO trainers of base A, base B (same architecture, other seed), then
    A again: B computes its own reference from its own weights, A's second trainer reuses A's entry on both ranks.
    The base is identified by its files, then (in the same launch, on an empty cache, as a model built in memory) by
    its weights gathered from the shards."""
    bases = {"a": save_tiny_llama(tmp_path / "base-a", smol_tokenizer, seed=1),
             "b": save_tiny_llama(tmp_path / "base-b", smol_tokenizer, seed=2)}
    data = conversational_pairs(tmp_path / "p.jsonl")
    # every weight partitioned, none kept gathered after use: as on a 7B-70B model, where each rank holds shards only
    zero3 = json.loads((REPO / "hf_tune" / "ds_configs" / "zero3.json").read_text())
    zero3["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0,
                                      stage3_max_reuse_distance=0)
    (tmp_path / "zero3.json").write_text(json.dumps(zero3))
    identities = {"files": tmp_path / "cache-files", "weights": tmp_path / "cache-weights"}
    phases = []
    for identity, cache in identities.items():
        recipes = []
        for run, base in (("a", "a"), ("b", "b"), ("a-again", "a")):
            raw = method_recipe("dpo", bases[base], data, tmp_path / identity / run,
                                deepspeed=str(tmp_path / "zero3.json"), per_device_train_batch_size=1)
            recipes.append(tmp_path / f"{identity}-{run}.yaml")
            recipes[-1].write_text(yaml.safe_dump(raw))
        phases.append(",".join([identity, str(cache), *map(str, recipes)]))
    result = launch.run(*launch.zero(2, str(REPO / "tests" / "reference_cache_probe.py"),
                                          str(tmp_path / "report"), *phases), env=launch.TORCH_EXTENSIONS, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"report.rank{rank}").read_text()) for rank in (0, 1)]
    rows = ranks[0][0]["trainers"][0]["rows"]
    examples = [(row["prompt_ids"], row["chosen_ids"]) for row in rows]
    expected = {name: chosen_logps(bases[name], rows) for name in ("a", "b")}  # computed here, in one process
    for phase, (identity, cache) in enumerate(identities.items()):
        for rank in ranks:
            assert rank[phase]["identity"] == identity
            a, b, a_again = rank[phase]["trainers"]
            assert (a["hits"], b["hits"], a_again["hits"]) == (0, 0, 1)  # every rank took the main process's branch
            got = {"a": [row["ref_chosen_logps"] for row in a["rows"]],
                   "b": [row["ref_chosen_logps"] for row in b["rows"]]}
            for trainer in (a, b):  # the rows the expected log-probabilities were computed for
                assert [(row["prompt_ids"], row["chosen_ids"]) for row in trainer["rows"]] == examples
            for name in ("a", "b"):  # each base's own log-probabilities, not the other's
                assert got[name] == pytest.approx(expected[name], abs=1e-4)
            assert [row["ref_chosen_logps"] for row in a_again["rows"]] == got["a"]
        assert len(list((cache / "reference_logps").glob("*.parquet"))) == 2
        keyed_by_weights = any("keyed by a hash of its weights" in message
                               for rank in ranks for message in rank[phase]["messages"])
        assert keyed_by_weights == (identity == "weights")


def test_equal_examples_have_one_digest_whatever_their_arrow_layout():
    """Equal rows held in other chunks (a rank that read the map cache, another tokenizer object) share a key;
    the Arrow IPC bytes hashed before differed for them."""
    from datasets import Dataset, concatenate_datasets

    from hf_tune.trainer.reference import examples_digest

    rows = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4], "text": "a"}, {"prompt_ids": [5], "chosen_ids": [6, 7],
                                                                       "text": "b"}]
    whole = Dataset.from_list(rows)
    pieces = concatenate_datasets([Dataset.from_list(rows[:1]), Dataset.from_list(rows[1:])])
    assert examples_digest(whole) == examples_digest(pieces)
    assert examples_digest(whole) != examples_digest(Dataset.from_list([rows[0], {**rows[1], "chosen_ids": [6, 8]}]))
    assert examples_digest(whole) != examples_digest(Dataset.from_list([{**rows[0], "prompt_ids": [1, 2]},
                                                                        {**rows[1], "prompt_ids": [3, 5]}]))


def test_a_file_is_hashed_once_and_a_hub_blob_by_its_name(tmp_path, monkeypatch):
    import hashlib

    from hf_tune.trainer.reference import file_sha256

    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights one")
    assert file_sha256(weights) == hashlib.sha256(b"weights one").hexdigest()
    stat = weights.stat()
    weights.write_bytes(b"weights two")  # same size and, restored below, same mtime: the kept hash is used
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_sha256(weights) == hashlib.sha256(b"weights one").hexdigest()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: hashed again
    assert file_sha256(weights) == hashlib.sha256(b"weights two").hexdigest()
    blob = tmp_path / "hub" / "blobs" / ("ab" * 32)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"not read")
    (tmp_path / "hub" / "model.safetensors").symlink_to(blob)
    assert file_sha256(tmp_path / "hub" / "model.safetensors") == "ab" * 32


def test_the_base_identity_follows_its_files_not_its_folder(tmp_path, smol_tokenizer, monkeypatch):
    import shutil

    from transformers import AutoModelForCausalLM

    from hf_tune.trainer.reference import files_identity

    monkeypatch.setenv("HF_TUNE_CACHE", str(tmp_path / "cache"))
    folders = {seed: save_tiny_llama(tmp_path / f"seed{seed}", smol_tokenizer, seed) for seed in (1, 2)}
    shutil.copytree(folders[1], tmp_path / "copy")
    identity = {name: files_identity(AutoModelForCausalLM.from_pretrained(path))
                for name, path in (("one", folders[1]), ("two", folders[2]), ("copy", tmp_path / "copy"))}
    assert identity["one"].startswith("files:") and identity["one"] == identity["copy"] != identity["two"]
    resized = AutoModelForCausalLM.from_pretrained(folders[1])
    resized.resize_token_embeddings(len(smol_tokenizer) + 1)  # new rows drawn at random: not the files any more
    assert files_identity(resized) is None
    model = AutoModelForCausalLM.from_config(resized.config)  # built in memory: no files
    assert files_identity(model) is None


def test_a_hub_base_is_found_in_the_hub_cache_at_its_recorded_revision(tmp_path, tiny_llama_dir):
    """The loader records where the weights came from; a Hub id resolves to the cached snapshot of that revision,
    and its file is identified by the blob's name (its sha256), reading nothing."""
    from hf_tune import build_model_and_tokenizer, load_recipe
    from hf_tune.trainer.reference import file_sha256, model_source, weight_files

    repo = tmp_path / "hub" / "models--org--tiny"
    for commit, sha in (("a" * 40, "1" * 64), ("b" * 40, "2" * 64)):
        (repo / "blobs" / sha).parent.mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / sha).write_bytes(b"weights")
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "model.safetensors").symlink_to(repo / "blobs" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    source = {"name_or_path": "org/tiny", "revision": "a" * 40, "cache_dir": str(tmp_path / "hub")}
    assert [file_sha256(f) for f in weight_files(source)] == ["1" * 64]
    assert [file_sha256(f) for f in weight_files({**source, "revision": None})] == ["2" * 64]  # refs/main
    assert weight_files({"name_or_path": "org/tiny"}) is None  # revision not recorded: cannot tell

    model, _ = build_model_and_tokenizer(load_recipe(chat_recipe(tiny_llama_dir, tmp_path / "run")))
    assert model_source(model)["name_or_path"] == tiny_llama_dir and "revision" in model_source(model)
