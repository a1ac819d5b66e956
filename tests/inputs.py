"""Test inputs several test modules build, each in a few lines: preference pairs and method recipes, token
examples, a Ray search recipe and Ray's own record of it, and the layer-wise LR rule computed independently of
hf_tune. Kept here so that no test module imports another."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import yaml
from conftest import chat_recipe

BASE_LR, WD = 1e-3, 0.05  # the LR and weight decay the optimizer-group tests build with
TOKEN = "hf_testTOKENabcdef123"  # the shape of a Hub token, for the local Hub stand-in


def front_matter(readme: bytes) -> dict:
    """The YAML front matter of a model card."""
    return yaml.safe_load(readme.decode().split("---")[1])


PAIRS = [
    ("What is 2 + 2?", "2 + 2 = 4.", "2 + 2 = 5."),
    ("What is the capital of France?", "The capital of France is Paris.", "The capital of France is Lyon."),
    ("What is 3 + 5?", "3 + 5 = 8.", "3 + 5 = 9."),
    ("Spell 'cat' backwards.", "'cat' backwards is 'tac'.", "'cat' backwards is 'act'."),
    ("What is 10 - 4?", "10 - 4 = 6.", "10 - 4 = 7."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid.", "The capital of Spain is Rome."),
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def conversational_pairs(path: Path) -> Path:
    return write_jsonl(path, [{"prompt": [{"role": "user", "content": p}],
                               "chosen": [{"role": "assistant", "content": c}],
                               "rejected": [{"role": "assistant", "content": r}]} for p, c, r in PAIRS])


def method_recipe(method: str, model: str, data: Path, out: Path, lora: bool = True, **training) -> dict:
    raw = {"method": method, "model": {"pretrained_model_name_or_path": model},
           "data": {"train": {"path": str(data)}},
           "training": {"output_dir": str(out), "max_steps": 2, "per_device_train_batch_size": 2,
                        "learning_rate": 1e-3, "report_to": "none", "logging_steps": 1, "save_strategy": "no",
                        "disable_tqdm": True, "bf16": False, "gradient_checkpointing": False, **training}}
    if lora:
        raw["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    return raw


def make_examples(n_tokens: list[int], seed: int = 0, vocab: int = 1000) -> list[dict]:
    """Examples whose labels mask a prompt of a third of the tokens, like a chat."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in n_tokens:
        ids = torch.randint(10, vocab, (n,), generator=g).tolist()
        prompt = n // 3
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def ray_recipe(model_dir: str, out: Path, search_section: dict, **training) -> dict:
    settings = {"max_steps": 6, "per_device_train_batch_size": 4, "eval_strategy": "steps", "eval_steps": 2,
                "learning_rate": 1e-3, "seed": 7, **training}
    raw = chat_recipe(model_dir, out, **settings)
    raw["data"]["eval_split"] = 0.05
    raw["data"]["max_length"] = 64
    raw["lora"] = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    raw["search"] = {"backend": "ray", "n_trials": 4, **search_section}
    return raw


def reported(experiment: Path) -> dict[int, list[dict]]:
    """Ray's own record of every result each trial reported (result.json in each trial's folder), by trial number."""
    results = {}
    for path in experiment.glob("*/result.json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        results[int(rows[0]["trial_id"].rsplit("_", 1)[-1])] = rows
    return dict(sorted(results.items()))


# Independent definitions per family: (block regex, embedding regex, no-decay regex)
FAMILIES = {
    "llama": (r"model\.layers\.(\d+)\.", r"embed_tokens", r"(norm|bias|embed_tokens)"),
    "bert": (r"bert\.encoder\.layer\.(\d+)\.", r"bert\.embeddings\.", r"(bias|LayerNorm|embeddings)"),
    "gpt2": (r"transformer\.h\.(\d+)\.", r"transformer\.(wte|wpe)\.", r"(bias|ln_|wte|wpe)"),
}


def expected(name: str, family: str, num_blocks: int, decay: float, head_lr: float | None = None,
             base_lr: float = BASE_LR, weight_decay: float = WD):
    """(LR, weight decay) of parameter ``name`` by the rule written here: depth 0 the embeddings, 1..num_blocks the
    blocks, num_blocks + 1 the head; LR ``base_lr * decay ** (num_blocks + 1 - depth)``; no decay on norms, biases
    and embeddings (LoRA's tensors always decay)."""
    block, embedding, no_decay = FAMILIES[family]
    match = re.search(block, name)
    depth = int(match.group(1)) + 1 if match else 0 if re.search(embedding, name) else num_blocks + 1
    lr = base_lr * decay ** (num_blocks + 1 - depth)
    if head_lr is not None and depth == num_blocks + 1:
        lr = head_lr
    wd = 0.0 if re.search(no_decay, name) and "lora_" not in name else weight_decay
    return lr, wd
