"""A Hub model or dataset the recipe names is checked before any model loads: online, the Hub (a local stand-in at
HF_ENDPOINT: the network boundary) says whether the repo and revision exist and whether this token may read a gated
repo; offline, the local cache says whether it is there. The message names the recipe key and the fix, never the
token."""

from __future__ import annotations

import json

import pytest
from conftest import DATA, chat_recipe
from fake_dataset_hub import DatasetHub
from huggingface_hub import constants, hf_hub_download

from hf_tune import load_recipe
from hf_tune.errors import HfTuneError, RecipeError
from hf_tune.runtime.network import hub_is_reachable

TOKEN = "hf_granted0123456789secret"
CONFIG = json.dumps({"model_type": "llama", "hidden_size": 32}).encode()
CHATS = "".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                         {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                for i in range(8)).encode()
MODELS = {"someorg/open-model": {"main": ("c" * 40, {"config.json": CONFIG})},
          "someorg/gated-model": {"main": ("d" * 40, {"config.json": CONFIG})}}
DATASETS = {"someorg/chats": {"main": ("e" * 40, {"data/train.jsonl": CHATS})},
            "someorg/gated-chats": {"main": ("f" * 40, {"data/train.jsonl": CHATS})}}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The stand-in Hub, a token of this machine granted nothing gated but 'someorg/gated-model', fresh caches."""
    import datasets

    gated = {"someorg/gated-model": {TOKEN}, "someorg/gated-chats": set()}
    with DatasetHub(DATASETS, models=MODELS, gated=gated, invalid_tokens={"hf_expired_token"}) as fake:
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                            fake.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", fake.url)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        hub_is_reachable.cache_clear()
        yield fake
    hub_is_reachable.cache_clear()


def recipe(model: str, tmp_path, train: dict | None = None, **model_keys) -> dict:
    raw = chat_recipe(model, tmp_path / "run")
    raw["model"].update(model_keys)
    if train is not None:
        raw["data"]["train"] = train
    return raw


def refusal(raw: dict) -> RecipeError:
    with pytest.raises(RecipeError) as refused:
        load_recipe(raw)
    assert TOKEN not in str(refused.value)
    return refused.value


def test_a_model_repo_the_hub_does_not_have_is_refused_with_the_spelling_fix(hub, tmp_path):
    error = refusal(recipe("someorg/no-such-model", tmp_path))
    assert error.key == "model.pretrained_model_name_or_path"
    assert "the Hub has no model 'someorg/no-such-model' that this machine's Hub token can read" in error.problem
    assert "check the spelling" in error.fix and "local path" in error.fix
    assert ("GET", "/api/models/someorg/no-such-model") in hub.requests


def test_a_gated_model_this_token_may_not_read_names_the_page_to_accept_its_licence(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_other_account_token")
    error = refusal(recipe("someorg/gated-model", tmp_path))
    assert error.key == "model.pretrained_model_name_or_path"
    assert f"{hub.url}/someorg/gated-model is gated" in error.problem
    assert f"accept its conditions at {hub.url}/someorg/gated-model" in error.fix and "hf auth login" in error.fix
    assert "hf_other_account_token" not in str(error)
    assert "Bearer hf_other_account_token" in hub.authorizations  # the user's token was the one asked about


def test_a_gated_model_this_token_was_granted_passes(hub, tmp_path):
    loaded = load_recipe(recipe("someorg/gated-model", tmp_path))
    assert loaded.model.pretrained_model_name_or_path == "someorg/gated-model"
    assert ("GET", "/api/models/someorg/gated-model/auth-check") in hub.requests


def test_an_expired_token_is_named_as_the_problem_without_being_shown(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_expired_token")
    error = refusal(recipe("someorg/open-model", tmp_path))
    assert error.key == "model.pretrained_model_name_or_path" and "refused this machine's Hub token" in error.problem
    assert "hf_expired_token" not in str(error)


def test_a_model_revision_the_repo_lacks_is_blamed_on_model_revision(hub, tmp_path):
    error = refusal(recipe("someorg/open-model", tmp_path, revision="v9"))
    assert error.key == "model.revision" and "has no revision 'v9'" in error.problem


def test_a_missing_and_a_gated_dataset_are_both_reported_and_an_existing_one_passes(hub, tmp_path, tiny_llama_dir):
    good = load_recipe(recipe(tiny_llama_dir, tmp_path, {"path": "someorg/chats"}))
    assert good.data.train.path == "someorg/chats"
    raw = recipe(tiny_llama_dir, tmp_path, [{"path": "someorg/chats", "weight": 1},
                                            {"path": "someorg/no-such-chats", "weight": 1},
                                            {"path": "someorg/gated-chats", "weight": 1}])
    with pytest.raises(HfTuneError) as refused:
        load_recipe(raw)
    message = str(refused.value)
    assert "data.train[1].path: the Hub has no dataset 'someorg/no-such-chats'" in message
    assert f"data.train[2].path: {hub.url}/datasets/someorg/gated-chats is gated" in message
    assert "data.train[0]" not in message and TOKEN not in message


def test_offline_a_dataset_not_in_the_cache_is_refused_and_a_cached_one_loads(hub, tmp_path, tiny_llama_dir,
                                                                             smol_tokenizer, monkeypatch):
    import datasets

    from hf_tune.data import build_datasets

    raw = recipe(tiny_llama_dir, tmp_path, {"path": "someorg/chats"})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    error = refusal(raw)
    assert error.key == "data.train.path"
    assert error.problem == "HF_HUB_OFFLINE is set and the Hub dataset 'someorg/chats' is not in the datasets cache"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    datasets.load_dataset("someorg/chats")  # online once: the datasets cache now holds it
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    asked = len(hub.requests)
    train, _ = build_datasets(load_recipe(raw), smol_tokenizer)  # the check agrees with what load_dataset reads
    assert len(train) == 8 and len(hub.requests) == asked  # nothing was asked of the Hub offline


def test_offline_a_model_not_in_the_cache_is_refused_and_a_cached_one_passes(hub, tmp_path, monkeypatch):
    raw = recipe("someorg/open-model", tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    error = refusal(raw)
    assert error.key == "model.pretrained_model_name_or_path"
    assert error.problem == "HF_HUB_OFFLINE is set and 'someorg/open-model' is not in the local Hub cache"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hf_hub_download("someorg/open-model", "config.json")  # online once: the Hub cache now holds its config
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    asked = len(hub.requests)
    assert load_recipe(raw).model.pretrained_model_name_or_path == "someorg/open-model"
    assert len(hub.requests) == asked


def test_an_unreachable_hub_is_named_by_its_endpoint(hub, tmp_path, tiny_llama_dir, monkeypatch):
    from conftest import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    error = refusal(recipe(tiny_llama_dir, tmp_path, {"path": "someorg/chats"}))
    assert error.problem == f"the Hub ({endpoint}) is unreachable and the Hub dataset 'someorg/chats' is not in the " \
                            "datasets cache"


def test_local_files_and_packaged_builders_ask_nothing_of_the_hub(hub, tmp_path, tiny_llama_dir):
    load_recipe(recipe(tiny_llama_dir, tmp_path, {"path": "json", "data_files": str(DATA / "chat_demo.jsonl")}))
    load_recipe(recipe(tiny_llama_dir, tmp_path))
    assert [r for r in hub.requests if "/api/" in r[1]] == []
