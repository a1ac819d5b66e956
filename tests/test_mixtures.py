"""Several training sources, each with its own format, columns and weight or epochs; column mapping; split slices
(hf_tune/data/mixture.py, hf_tune/data/loading.py, hf_tune/recipe/data_checks.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import DATA, chat_recipe

from hf_tune.errors import HfTuneError

CHAT, ALPACA, TEXT, SHAREGPT = (str(DATA / f"{n}.jsonl") for n in ("chat_demo", "alpaca_demo", "text_demo",
                                                                   "sharegpt_demo"))


def recipe_with(tiny_llama_dir, tmp_path, data: dict, **training) -> dict:
    recipe = chat_recipe(tiny_llama_dir, tmp_path / "run", **training)
    recipe["data"] = {"format": "chat", "max_length": 256, **data}
    return recipe


def load(recipe: dict):
    from hf_tune import load_recipe

    return load_recipe(recipe)


@pytest.mark.parametrize("train, key, message", [
    ([{"path": CHAT, "weight": 2}, {"path": TEXT, "format": "text"}], r"data.train\[1\].weight",
     "is missing: give every source of a weighted mixture a weight"),
    ([{"path": CHAT, "weight": 1, "epochs": 2}, {"path": TEXT, "weight": 1}], r"data.train\[0\].weight",
     "is set together with epochs"),
    ({"path": CHAT, "weight": 1}, "data.train", "weights a single source"),
    ([{"path": CHAT}, {"pth": TEXT}], r"data.train\[1\].pth", "unknown key\n  fix: did you mean 'path'"),
    ([{"path": CHAT}, {"path": TEXT, "format": "classification"}], r"data.train\[1\].format",
     "'classification': a source may differ from data.format"),
    ([{"path": CHAT}, {"path": "missing.jsonl"}], r"data.train\[1\].path", "file not found"),
])
def test_a_mixture_that_cannot_work_is_refused_when_the_recipe_loads(tmp_path, tiny_llama_dir, train, key, message):
    with pytest.raises(HfTuneError, match=rf"{key}: {message}"):
        load(recipe_with(tiny_llama_dir, tmp_path, {"train": train}))


def test_a_classification_recipe_takes_one_source(tmp_path, tiny_llama_dir):
    topics = str(DATA / "topics_train.jsonl")
    recipe = recipe_with(tiny_llama_dir, tmp_path, {"format": "classification", "train": [{"path": topics}] * 2})
    recipe["model"]["task"] = "sequence_classification"
    with pytest.raises(HfTuneError, match="data.train: a list of sources .* takes the formats"):
        load(recipe)


def test_columns_map_the_formats_names_onto_the_datasets(tmp_path, tiny_llama_dir, smol_tokenizer):
    from hf_tune.data import build_datasets

    rows = [json.loads(line) for line in open(SHAREGPT)]
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({"dialogue": r["conversations"], "id": i}) + "\n" for i, r in enumerate(rows)))
    mapped, _ = build_datasets(load(recipe_with(tiny_llama_dir, tmp_path, {
        "train": {"path": str(renamed), "columns": {"conversations": "dialogue"}}})), smol_tokenizer)
    original, _ = build_datasets(load(recipe_with(tiny_llama_dir, tmp_path, {"train": {"path": SHAREGPT}})),
                                 smol_tokenizer)
    assert mapped["input_ids"] == original["input_ids"] and mapped["labels"] == original["labels"]

    with pytest.raises(HfTuneError, match=r"data.train.columns: .*renamed.jsonl has no column 'dialog'; its columns "
                                          r"are \['dialogue', 'id'\]"):
        build_datasets(load(recipe_with(tiny_llama_dir, tmp_path, {
            "train": {"path": str(renamed), "columns": {"conversations": "dialog"}}})), smol_tokenizer)


@pytest.mark.parametrize("split, rows", [("train[:25%]", range(0, 50)), ("train[10:13]", range(10, 13)),
                                         ("train[-2:]", range(198, 200))])
def test_a_split_slice_selects_those_examples(tmp_path, tiny_llama_dir, smol_tokenizer, split, rows):
    from hf_tune.data import build_datasets

    texts = [json.loads(line)["text"] for line in open(TEXT)]
    train, _ = build_datasets(load(recipe_with(tiny_llama_dir, tmp_path, {
        "format": "text", "train": {"path": TEXT, "split": split}})), smol_tokenizer)
    expected = [smol_tokenizer(texts[i])["input_ids"] + [smol_tokenizer.eos_token_id] for i in rows]
    assert train["input_ids"] == expected


def source_of(tokenizer, sources: list[tuple[str, str]]) -> dict[tuple, int]:
    """Each source tokenized on its own: token sequence -> the index of the source that holds it (``.counts``: how
    often each sequence occurs in its source)."""
    from hf_tune.data.loading import load_source
    from hf_tune.data.tokenization import tokenize_dataset
    from hf_tune.recipe.schema import DataSection, DatasetSource

    owner = SourceIndex()
    for i, (path, format) in enumerate(sources):
        data = DataSection(train={"path": path}, format=format, max_length=256)
        raw = load_source(DatasetSource(path=path), "data.train", format)
        for ids in tokenize_dataset(raw, tokenizer, data, "data.train")["input_ids"]:
            assert owner.setdefault(tuple(ids), i) == i  # the sources share no example: each is told by its tokens
            owner.counts[tuple(ids)] += 1
    return owner


class SourceIndex(dict):
    def __init__(self):
        super().__init__()
        self.counts = Counter()


def write_chats(path, n: int) -> str:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                     {"role": "assistant", "content": f"1 ... {i}"}]}) + "\n"
                            for i in range(n)))
    return str(path)


@pytest.fixture
def three(tmp_path):
    """Three sources of three formats: 400 chats, 40 instructions, 200 texts."""
    return [(write_chats(tmp_path / "chats.jsonl", 400), "chat"), (ALPACA, "instruction"), (TEXT, "text")]


def test_epochs_fix_how_often_each_source_is_seen(tmp_path, tiny_llama_dir, smol_tokenizer, three):
    from hf_tune.data import build_training_data

    train = [{"path": three[0][0], "epochs": 0.25}, {"path": ALPACA, "format": "instruction", "epochs": 2},
             {"path": TEXT, "format": "text"}]
    data = build_training_data(load(recipe_with(tiny_llama_dir, tmp_path, {"train": train})), smol_tokenizer)
    owner = source_of(smol_tokenizer, three)
    seen = Counter(tuple(ids) for ids in data.train["input_ids"])
    per_source = Counter(owner[tuple(ids)] for ids in data.train["input_ids"])
    assert per_source == {0: 100, 1: 80, 2: 200}  # a quarter of 400 chats, 40 instructions twice, 200 texts once
    assert all(seen[ids] == 2 * n for ids, n in owner.counts.items() if owner[ids] == 1)  # each instruction twice
    assert max(n for ids, n in seen.items() if owner[ids] == 0) == 1  # a quarter: no chat twice
    assert [data.sources[f"train[{i}]"]["examples"] for i in range(3)] == [100, 80, 200]


def test_a_weighted_mixture_is_seeded_and_counts_what_each_source_gave(tmp_path, tiny_llama_dir, smol_tokenizer,
                                                                       three):
    from hf_tune.data import build_training_data

    train = [{"path": three[0][0], "weight": 0.5}, {"path": ALPACA, "format": "instruction", "weight": 0.2},
             {"path": TEXT, "format": "text", "weight": 0.3}]
    recipe = recipe_with(tiny_llama_dir, tmp_path, {"train": train}, seed=3)
    data = build_training_data(load(recipe), smol_tokenizer)
    owner = source_of(smol_tokenizer, three)
    per_source = Counter(owner[tuple(ids)] for ids in data.train["input_ids"])
    assert [per_source[i] for i in range(3)] == [data.sources[f"train[{i}]"]["examples"] for i in range(3)]
    assert per_source[1] == 40  # first_exhausted (upstream's default): the mixture ends when ALPACA's 40 are drawn
    assert 0.4 < per_source[1] / per_source[0] < 0.6 and 0.45 < per_source[1] / per_source[2] < 0.9  # 2/5, 2/3
    again = build_training_data(load(recipe), smol_tokenizer)
    assert again.train["input_ids"] == data.train["input_ids"]  # what every rank computes
    other = build_training_data(load(recipe_with(tiny_llama_dir, tmp_path, {"train": train}, seed=4)), smol_tokenizer)
    assert other.train["input_ids"] != data.train["input_ids"]
    assert data.sources["train[2]"]["format"] == "text" and data.sources["train[0]"]["path"] == three[0][0]
    assert len({data.sources[f"train[{i}]"]["fingerprint"] for i in range(3)}) == 3


def test_eval_split_holds_out_a_fraction_of_each_source(tmp_path, tiny_llama_dir, smol_tokenizer, three):
    from hf_tune.data import build_training_data

    train = [{"path": ALPACA, "format": "instruction"}, {"path": TEXT, "format": "text"}]
    data = build_training_data(load(recipe_with(tiny_llama_dir, tmp_path, {"train": train, "eval_split": 0.1})),
                               smol_tokenizer)
    owner = source_of(smol_tokenizer, three[1:])
    assert Counter(owner[tuple(ids)] for ids in data.eval["input_ids"]) == {0: 4, 1: 20}
    together = Counter(tuple(i) for i in [*data.eval["input_ids"], *data.train["input_ids"]])
    assert together == owner.counts  # a split: every example once, in train or in eval


def test_a_three_source_mixture_trains_and_its_manifest_says_what_each_gave(tmp_path, tiny_llama_dir,
                                                                           smol_tokenizer):
    from hf_tune import train

    chats = [json.loads(line)["messages"] for line in open(write_chats(tmp_path / "chats.jsonl", 60))]
    renamed = tmp_path / "dialogues.jsonl"  # ShareGPT turns under another column name
    renamed.write_text("".join(json.dumps({"dialogue": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]],
                                                         "value": m["content"]} for m in c]}) + "\n" for c in chats))
    sources = [{"path": str(renamed), "columns": {"conversations": "dialogue"}, "weight": 3},
               {"path": ALPACA, "format": "instruction", "weight": 1}, {"path": TEXT, "format": "text", "weight": 2}]
    recipe = recipe_with(tiny_llama_dir, tmp_path, {"train": sources, "batch_tokens": 512}, max_steps=3)
    trainer = train(load(recipe))
    assert len([log for log in trainer.state.log_history if "loss" in log]) == 3
    manifest = json.loads((tmp_path / "run" / "run.json").read_text())
    gave = [manifest["datasets"][f"train[{i}]"]["examples"] for i in range(3)]
    owner = source_of(smol_tokenizer, [(str(tmp_path / "chats.jsonl"), "chat"), (ALPACA, "instruction"), (TEXT, "text")])
    packed = Counter(owner[tuple(ids)] for pack in trainer.train_dataset["input_ids"] for ids in pack)
    assert gave == [packed[i] for i in range(3)] and sum(gave) > 0 and 0 not in gave
    assert manifest["datasets"]["train[1]"]["format"] == "instruction"


@pytest.fixture
def dataset_hub(monkeypatch, tmp_path):
    """A Hub dataset with two revisions: 'v1.0' holds other chats than 'main'; its column is 'conversation'."""
    import datasets
    import huggingface_hub.constants as constants
    from fake_dataset_hub import DatasetHub

    def chats(tag: str) -> bytes:
        return "".join(json.dumps({"conversation": [{"role": "user", "content": f"{tag} question {i}"},
                                                    {"role": "assistant", "content": f"{tag} answer {i}"}]}) + "\n"
                       for i in range(40)).encode()

    repos = {"someorg/chats": {"main": ("b" * 40, {"data/train.jsonl": chats("main")}),
                               "v1.0": ("a" * 40, {"data/train.jsonl": chats("v1")})}}
    with DatasetHub(repos) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", hub.url)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
        yield hub


def test_a_hub_dataset_at_a_revision_with_a_split_slice_and_mapped_columns(tmp_path, tiny_llama_dir, smol_tokenizer,
                                                                          dataset_hub):
    from hf_tune.data import build_datasets

    source = {"path": "someorg/chats", "revision": "v1.0", "split": "train[:10%]",
              "columns": {"messages": "conversation"}}
    train, _ = build_datasets(load(recipe_with(tiny_llama_dir, tmp_path, {"train": source})), smol_tokenizer)
    answers = [smol_tokenizer.decode([t for t in labels if t != -100]) for labels in train["labels"]]
    assert answers == [f"v1 answer {i}<|im_end|>" for i in range(4)]  # the tag's rows, the first 10 %
    assert any("/resolve/v1.0/" in path for _, path in dataset_hub.requests)
