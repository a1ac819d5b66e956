"""Padding-free batches, token-budget packs and the trained-positions loss give exactly the unpacked losses and
gradients (hf_tune/data/packing.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, chat_recipe
from inputs import make_examples

LENGTHS = [37, 5, 90, 12, 61, 3, 44, 20]  # deliberately ragged


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa")


def per_example_reference(model, example: dict) -> tuple[float, int]:
    """Sum of next-token losses and the count of trained tokens of one example run alone (no batch, no padding)."""
    model.eval()
    ids = torch.tensor([example["input_ids"]])
    labels = torch.tensor(example["labels"])
    logits = model(input_ids=ids).logits[0, :-1]
    targets = labels[1:]
    keep = targets != -100
    return F.cross_entropy(logits[keep], targets[keep], reduction="sum").item(), int(keep.sum())


@pytest.mark.parametrize("padding_free", [True, False])
def test_per_example_losses_in_a_batch_equal_each_example_alone(tiny_model, smol_tokenizer, padding_free):
    from hf_tune.data.collator import CausalLMCollator

    examples = make_examples(LENGTHS)
    batch = CausalLMCollator(smol_tokenizer, padding_free=padding_free, trainable_logits_only=False)(examples)
    labels = batch.pop("labels")
    tiny_model.train()  # as in training (the model has no dropout): a train-mode forward is where a cache once hid
    with torch.no_grad():  # the packed-sequence mask
        logits = tiny_model(**batch).logits
        token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
        token_loss = token_loss * (labels[:, 1:] != -100)
        if padding_free:  # one row: split it back into examples by where the positions restart
            starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist() + [labels.shape[1]]
            sums = [token_loss[0, a:b - 1].sum().item() for a, b in zip(starts, starts[1:])]
            assert token_loss[0, [b - 1 for b in starts[1:-1]]].abs().sum() == 0  # no target across a boundary
        else:
            sums = token_loss.sum(dim=1).tolist()
        for example, got in zip(examples, sums):
            expected, _ = per_example_reference(tiny_model, example)
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("padding_free", [True, False])
def test_the_trained_positions_loss_equals_the_mean_over_every_trained_token(tiny_model, smol_tokenizer,
                                                                               padding_free):
    from hf_tune.data.collator import CausalLMCollator
    from hf_tune.model.loss import causal_lm_loss

    examples = make_examples(LENGTHS, seed=1)
    batch = CausalLMCollator(smol_tokenizer, padding_free=padding_free, trainable_logits_only=True)(examples)
    labels = batch.pop("labels")
    with torch.no_grad():
        outputs = tiny_model(**batch)
        refs = [per_example_reference(tiny_model, e) for e in examples]
    assert outputs.logits.shape[0] == sum(n for _, n in refs)  # only trained positions were projected
    expected = sum(s for s, _ in refs) / sum(n for _, n in refs)
    assert causal_lm_loss(outputs, labels).item() == pytest.approx(expected, rel=1e-5)
    assert causal_lm_loss(outputs, labels, num_items_in_batch=torch.tensor(1000)).item() == pytest.approx(
        sum(s for s, _ in refs) / 1000, rel=1e-5)


def test_token_budget_packs_hold_every_example_once_grouped_by_length():
    from datasets import Dataset

    from hf_tune.data.packing import pack_by_token_budget

    lengths = [int(x) for x in torch.randint(1, 120, (200,), generator=torch.Generator().manual_seed(0))]
    examples = [{"input_ids": [i] * n, "labels": [i] * n} for i, n in enumerate(lengths)]  # id i marks example i
    packs = pack_by_token_budget(Dataset.from_list(examples), batch_tokens=512, seed=3)
    seen = sorted(ids[0] for pack in packs["input_ids"] for ids in pack)
    assert seen == list(range(200))
    sizes = [sum(len(ids) for ids in pack) for pack in packs["input_ids"]]
    assert max(sizes) <= 512
    assert sum(sizes[:-1]) / (len(sizes[:-1]) * 512) > 0.9  # nearly full packs (the last takes what is left)
    spreads = [max(map(len, pack)) - min(map(len, pack)) for pack in packs["input_ids"]]
    assert max(spreads) < 30  # similar lengths in a pack: little padding when padded
    again = pack_by_token_budget(Dataset.from_list(examples), batch_tokens=512, seed=3)
    assert again["input_ids"] == packs["input_ids"]


def greedy_packs_reference(lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """The packing rule written plainly: a seeded shuffle (numpy's permutation), a stable sort by length, greedy
    filling."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    order.sort(key=lengths.__getitem__)
    packs, filled = [], batch_tokens
    for i in order:
        if filled + lengths[i] > batch_tokens:
            packs.append([])
            filled = 0
        packs[-1].append(i)
        filled += lengths[i]
    return packs


def test_packs_are_built_in_arrow_cached_by_fingerprint_and_follow_a_reordered_dataset(tmp_path):
    """A tokenized dataset read from a cache file, reordered by an indices mapping (as a mixture is): the packs hold
    the examples the rule picks, with their tokens and labels; a second call reads the packs the first wrote."""
    from datasets import load_dataset

    from hf_tune.data.packing import pack_by_token_budget

    lengths = [int(x) for x in torch.randint(1, 90, (300,), generator=torch.Generator().manual_seed(1))]
    rows = [{"input_ids": [i] * n, "labels": [-100] + [i] * (n - 1)} for i, n in enumerate(lengths)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenized = load_dataset("json", data_files=str(tmp_path / "t.jsonl"), split="train",
                             cache_dir=str(tmp_path / "cache"))
    reordered = tokenized.select(list(range(299, -1, -1)))  # row j is example 299 - j
    packs = pack_by_token_budget(reordered, batch_tokens=256, seed=5)
    expected = greedy_packs_reference(lengths[::-1], 256, 5)
    assert [[299 - j for j in pack] for pack in expected] == [[ids[0] for ids in p] for p in packs["input_ids"]]
    for pack_ids, pack_labels in zip(packs["input_ids"], packs["labels"]):
        for ids, labels in zip(pack_ids, pack_labels):
            assert ids == [ids[0]] * lengths[ids[0]] and labels == [-100] + ids[1:]
    (cache,) = packs.cache_files
    assert cache["filename"].startswith(str(tmp_path / "cache"))
    again = pack_by_token_budget(reordered, batch_tokens=256, seed=5)
    assert again.cache_files == packs.cache_files and again._fingerprint == packs._fingerprint
    assert pack_by_token_budget(reordered, batch_tokens=256, seed=6)._fingerprint != packs._fingerprint


def test_packs_hold_the_rows_a_shuffled_or_selected_dataset_shows(tmp_path):
    """Through an indices mapping (shuffle, select with repeats) and across Arrow chunks, each packed example is the
    dataset's row as read one by one, tokens and labels; every row is packed once."""
    from datasets import Dataset, concatenate_datasets

    from hf_tune.data.packing import pack_by_token_budget

    lengths = [int(x) for x in torch.randint(1, 60, (400,), generator=torch.Generator().manual_seed(2))]
    rows = [{"input_ids": [i] * n, "labels": [-100] + list(range(n - 1))} for i, n in enumerate(lengths)]
    chunked = concatenate_datasets([Dataset.from_list(rows[:150]), Dataset.from_list(rows[150:])])
    for dataset in (chunked.shuffle(seed=0), chunked.select([5, 399, 5, *range(200, 100, -1)])):
        expected = sorted((row["input_ids"], row["labels"]) for row in dataset)  # read one by one
        packs = pack_by_token_budget(dataset, batch_tokens=128, seed=1)
        packed = [(ids, labels) for pack in packs for ids, labels in zip(pack["input_ids"], pack["labels"])]
        assert sorted(packed) == expected
        assert max(sum(len(ids) for ids in pack) for pack in packs["input_ids"]) <= 128


def one_sgd_step(tmp_path, tiny_llama_dir, name: str, **data_and_training) -> dict[str, torch.Tensor]:
    """Weights after one plain-SGD step (lr 1, no clipping) of a full fine-tune on the 8 examples in chats.jsonl."""
    from safetensors.torch import load_file

    from hf_tune import load_recipe, train

    data = {k: data_and_training.pop(k) for k in ("padding_free", "batch_tokens") if k in data_and_training}
    recipe = chat_recipe(tiny_llama_dir, tmp_path / name, max_steps=1, optim="sgd", learning_rate=1.0,
                         max_grad_norm=0.0, lr_scheduler_type="constant", weight_decay=0.0, **data_and_training)
    recipe["data"].update(train={"path": str(tmp_path / "chats.jsonl")}, max_length=512, **data)
    recipe["model"]["dtype"] = "float32"
    train(load_recipe(recipe))
    return load_file(tmp_path / name / "model.safetensors")


def reference_sgd_step(tiny_llama_dir, examples: list[dict]) -> dict[str, torch.Tensor]:
    """The same step computed by hand: loss = every trained token's loss summed over the 8 examples (each run
    alone) divided by their number of trained tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    total, count = 0.0, 0
    for example in examples:
        ids, labels = torch.tensor([example["input_ids"]]), torch.tensor(example["labels"])
        logits = model(input_ids=ids).logits[0, :-1]
        keep = labels[1:] != -100
        total = total + F.cross_entropy(logits[keep], labels[1:][keep], reduction="sum")
        count += int(keep.sum())
    (total / count).backward()
    with torch.no_grad():
        return {name: p - p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
def test_gradient_accumulation_equals_the_full_batch_and_a_hand_computed_step(tmp_path, tiny_llama_dir,
                                                                              smol_tokenizer):
    """Batch 8 and batch 2 x 4 accumulation, padded and padding-free, and one token-budget pack, all give the
    weights of one SGD step computed by hand (the transformers #34191 class of bug: per-micro-batch means)."""
    from hf_tune.data.tokenization import tokenize_chat

    chats = [json.loads(line) for line in (DATA / "chat_demo.jsonl").read_text().splitlines()]
    chats = sorted(chats, key=lambda c: len(json.dumps(c)))[::50][:8]  # 8 chats of very different lengths
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    examples = []
    for chat in chats:
        ids, labels = tokenize_chat(smol_tokenizer, chat["messages"])
        examples.append({"input_ids": ids, "labels": labels})
    assert len({len(e["input_ids"]) for e in examples}) == 8
    expected = reference_sgd_step(tiny_llama_dir, examples)
    runs = {
        "full-padded": one_sgd_step(tmp_path, tiny_llama_dir, "a", per_device_train_batch_size=8, padding_free=False),
        "accum-padded": one_sgd_step(tmp_path, tiny_llama_dir, "b", per_device_train_batch_size=2,
                                     gradient_accumulation_steps=4, padding_free=False),
        "accum-flat": one_sgd_step(tmp_path, tiny_llama_dir, "c", per_device_train_batch_size=2,
                                   gradient_accumulation_steps=4, padding_free=True),
        "one-pack": one_sgd_step(tmp_path, tiny_llama_dir, "d", batch_tokens=4096, padding_free=True),
    }
    assert set(runs["full-padded"]) == set(expected)  # the tied head is one tensor in both
    for run, weights in runs.items():
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=2e-6, msg=f"{run}: {name}")


def test_sdpa_varlen_runs_each_flattened_example_apart_forward_and_backward(tiny_llama_dir, smol_tokenizer):
    """The default causal-LM attention (hf_tune/model/attention.py) on a flattened row of ragged examples: the loss and
    every gradient equal those of the examples run one by one through transformers' SDPA (GQA model: 4 query heads
    on 2 key-value heads)."""
    from transformers import AutoModelForCausalLM

    from hf_tune.data.collator import CausalLMCollator
    from hf_tune.model.attention import NAME
    from hf_tune.model.loss import causal_lm_loss

    examples = make_examples(LENGTHS, seed=2)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="sdpa")
    total, count = 0.0, 0
    for example in examples:
        s, n = per_example_reference_with_grad(reference, example)
        total, count = total + s, count + n
    (total / count).backward()

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation=NAME)
    assert model.config._attn_implementation == NAME
    batch = CausalLMCollator(smol_tokenizer, padding_free=True, trainable_logits_only=True,
                             example_boundaries=True)(examples)
    assert batch["cu_seq_lens_q"].tolist() == [sum(LENGTHS[:i]) for i in range(len(LENGTHS) + 1)]
    labels = batch.pop("labels")
    model.train()
    loss = causal_lm_loss(model(**batch), labels)
    loss.backward()
    assert loss.item() == pytest.approx((total / count).item(), rel=1e-5)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def per_example_reference_with_grad(model, example: dict) -> tuple[torch.Tensor, int]:
    ids, labels = torch.tensor([example["input_ids"]]), torch.tensor(example["labels"])
    logits = model(input_ids=ids).logits[0, :-1]
    keep = labels[1:] != -100
    return F.cross_entropy(logits[keep], labels[1:][keep], reduction="sum"), int(keep.sum())


def test_sdpa_varlen_is_plain_sdpa_on_padded_batches(tiny_llama_dir, smol_tokenizer):
    """Without example boundaries (padded rows: evaluation, generation, data.padding_free: false) sdpa_varlen is
    transformers' SDPA with its padding mask: the same logits at every real position."""
    from transformers import AutoModelForCausalLM

    from hf_tune.data.collator import CausalLMCollator
    from hf_tune.model.attention import NAME

    batch = CausalLMCollator(smol_tokenizer, padding_free=False, trainable_logits_only=False)(
        make_examples(LENGTHS, seed=3))
    batch.pop("labels")
    logits = {}
    for implementation in ("sdpa", NAME):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                     attn_implementation=implementation)
        with torch.no_grad():
            logits[implementation] = model(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[NAME][real], logits["sdpa"][real], rtol=0, atol=0)


@pytest.mark.parametrize("attn_implementation, padding_free, boundaries", [
    (None, True, True),  # the default: sdpa_varlen, packs flattened with boundaries
    ("sdpa", False, False),  # plain SDPA would compute a block mask over the whole pack: packs stay padded
    ("flash_attention_2", True, True),
])
def test_the_collator_flattens_packs_where_the_attention_runs_examples_apart(tiny_llama_dir, smol_tokenizer,
                                                                             attn_implementation, padding_free,
                                                                             boundaries):
    from transformers import LlamaForCausalLM

    from hf_tune import load_recipe
    from hf_tune.data import build_collator

    recipe = chat_recipe(tiny_llama_dir, "unused")
    recipe["data"]["batch_tokens"] = 512
    # the attention the built model runs (a recipe naming flash_attention_2 is refused where flash-attn is missing)
    collator = build_collator(load_recipe(recipe), smol_tokenizer, LlamaForCausalLM, attn_implementation)
    batch = collator(make_examples(LENGTHS))
    assert ("position_ids" in batch and batch["input_ids"].shape[0] == 1) == padding_free
    assert ("cu_seq_lens_q" in batch) == boundaries


@pytest.mark.parametrize("window", [200, 16])  # longer than every example (varlen path), shorter (plain SDPA)
def test_sdpa_varlen_keeps_a_sliding_window_exact(tmp_path, smol_tokenizer, window):
    """Mistral with a sliding window: a flattened row under sdpa_varlen gives each example's own logits, whether the
    window is longer than the longest example (runs apart: the window masks nothing more) or shorter (falls back to
    transformers' SDPA with its windowed block mask)."""
    from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

    from hf_tune.data.collator import CausalLMCollator
    from hf_tune.model.attention import NAME

    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=window)
                       ).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation=NAME)
    examples = make_examples(LENGTHS, seed=4)
    batch = CausalLMCollator(smol_tokenizer, padding_free=True, trainable_logits_only=False,
                             example_boundaries=True)(examples)
    batch.pop("labels")
    with torch.no_grad():
        row = model(**batch).logits[0]
        alone = [model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples]
    torch.testing.assert_close(row, torch.cat(alone), rtol=1e-4, atol=1e-5)


def test_the_collator_follows_the_attention_the_model_actually_runs(tiny_llama_dir, tmp_path):
    """The attention is decided once, when the model loads; the trainer's collator reads the model's choice instead
    of predicting it from the recipe (a model that runs eager gets padded packs, not example boundaries)."""
    from hf_tune import build_run, build_trainer, load_recipe
    from hf_tune.model.attention import NAME

    recipe = chat_recipe(tiny_llama_dir, tmp_path / "run")
    recipe["data"]["batch_tokens"] = 512
    run = build_run(load_recipe(recipe))
    assert run.model.config._attn_implementation == NAME
    flattened = run.trainer.data_collator(make_examples(LENGTHS))
    assert flattened["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in flattened

    run.model.set_attn_implementation("eager")  # as a model that cannot run SDPA loads
    trainer = build_trainer(run.recipe, run.model, run.tokenizer, run.data.train, run.data.eval, run.args)
    padded = trainer.data_collator(make_examples(LENGTHS))
    assert padded["input_ids"].shape[0] == len(LENGTHS) and "cu_seq_lens_q" not in padded


def test_sdpa_varlen_hands_a_call_with_an_unknown_argument_to_upstream_sdpa():
    """Only keyword arguments it understands run examples apart: any other one with a value (a future model's) goes
    to transformers' SDPA, whose result it then is."""
    from transformers import AttentionInterface

    from hf_tune.model.attention import sdpa_varlen_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = True
    query, key, value = (torch.randn(1, 2, 7, 8) for _ in range(3))
    boundaries = {"cu_seq_lens_q": torch.tensor([0, 3, 7]), "cu_seq_lens_k": torch.tensor([0, 3, 7]),
                  "max_length_q": 4, "max_length_k": 4}
    apart, _ = sdpa_varlen_attention_forward(module, query, key, value, None, **boundaries)
    handed_on, _ = sdpa_varlen_attention_forward(module, query, key, value, None, **boundaries, attention_sinks=1.0)
    upstream, _ = AttentionInterface()["sdpa"](module, query, key, value, None, **boundaries, attention_sinks=1.0)
    assert torch.equal(handed_on, upstream)
    assert torch.allclose(apart[:, :3], upstream[:, :3], atol=1e-6)  # the first example sees no other one anyway
    assert not torch.allclose(apart[:, 3:], upstream[:, 3:], atol=1e-3)  # the second attends only to itself apart


def test_trainer_steps_run_the_flattened_examples_apart(tiny_llama_dir, tmp_path, monkeypatch):
    """Under Trainer, whose forwards carry num_items_in_batch down to the attention, sdpa_varlen still runs each
    example of a pack on its own: one SDPA call over a batch of the pack's examples, not one over the whole row."""
    from hf_tune import build_run, load_recipe

    batch_sizes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, *args, **kwargs):  # the library function, watched: how many rows does attention see?
        batch_sizes.append(query.shape[0])
        return sdpa(query, *args, **kwargs)

    recipe = chat_recipe(tiny_llama_dir, tmp_path / "run", max_steps=1)
    recipe["data"]["batch_tokens"] = 512
    trainer = build_run(load_recipe(recipe)).trainer
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    trainer.train()
    assert batch_sizes and min(batch_sizes) > 1  # every call: several examples of one flattened row, apart
