"""Does the router's load-balancing loss keep a mixture of experts balanced while it is fine-tuned? Two full
fine-tunes of the same small random Qwen3-MoE (8 experts, 2 a token, routers trained) on the demo chats, one with
hf_tune's default (the config's router_aux_loss_coef) and one with model.router_aux_loss_coef: 0, one after the other.
For each: the final cross-entropy on the training chats, and the expert load over the held-out chats' tokens (the share
of token slots each expert receives: 1/8 each when balanced), as the largest share over the ideal and the number of
experts left with under a quarter of their share.

    python benchmarks/moe_router_loss.py [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def expert_load(model, tokenizer, chats: list[dict]) -> torch.Tensor:
    """Share of the top-k token slots each expert gets over every MoE layer, from the model's router logits."""
    counts = None
    with torch.no_grad():
        for chat in chats:
            ids = tokenizer.apply_chat_template(chat["messages"], return_tensors="pt", return_dict=True)["input_ids"]
            out = model(input_ids=ids, output_router_logits=True)
            for logits in out.router_logits:
                chosen = logits.float().topk(model.config.num_experts_per_tok, dim=-1).indices.reshape(-1)
                layer = torch.bincount(chosen, minlength=model.config.num_experts).float()
                counts = layer if counts is None else counts + layer
    return counts / counts.sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    from hf_tune import load_recipe, train
    from hf_tune.model.embedded import embedded_model_path

    chats = [json.loads(line) for line in (REPO / "examples/data/chat_demo.jsonl").read_text().splitlines()]
    work = Path(tempfile.mkdtemp(prefix="moe_router_"))
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("embedded:SmolLM2-135M-Instruct"))
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                            router_aux_loss_coef=0.01, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    rows = []
    for label, coefficient in (("router loss 0.01 (default)", None), ("no router loss", 0.0)):
        recipe = {"model": {"pretrained_model_name_or_path": str(work / "base"), "chunked_loss": False},
                  "data": {"format": "chat", "train": {"path": str(REPO / "examples/data/chat_demo.jsonl"),
                                                        "split": "train[:300]"}, "max_length": 128},
                  "training": {"output_dir": str(work / label.split()[0]), "max_steps": args.steps,
                               "per_device_train_batch_size": 8, "learning_rate": 3e-3, "report_to": "none",
                               "logging_steps": 10, "save_strategy": "no", "disable_tqdm": True, "seed": 1}}
        if coefficient is not None:
            recipe["model"]["router_aux_loss_coef"] = coefficient
        trainer = train(load_recipe(recipe))
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        model = AutoModelForCausalLM.from_pretrained(work / label.split()[0]).eval()
        load = expert_load(model, tokenizer, chats[300:])
        ideal = 1 / config.num_experts
        rows.append((label, losses[-1], float(load.max()) / ideal, int((load < ideal / 4).sum())))
    print("| run | final training loss | largest expert share / ideal | experts under 1/4 of their share |")
    print("|---|---|---|---|")
    for label, loss, ratio, starved in rows:
        print(f"| {label} | {loss:.3f} | {ratio:.2f} | {starved} |")


if __name__ == "__main__":
    main()
