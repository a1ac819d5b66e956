"""The Hugging Face Hub: reachability, merging a LoRA run, and pushing a run with its model card."""

from __future__ import annotations

import functools
import socket
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants


@functools.cache
def hub_is_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP probe of the Hub endpoint (``HF_ENDPOINT``). Without it, every offline ``from_pretrained`` of a
    Hub id spends ~25 s in retries before failing or falling back to the cache."""
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


UPLOAD_IGNORE = ["checkpoint-*", "checkpoint-*/**", "merged/**", "training_args.bin", "*.pt", "*.pth", "*.lock"]
MERGE_CHECK_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}  # max |Δ logit| / max |logit|


def _run_task(run_dir: Path) -> str:
    import yaml

    recipe = run_dir / "recipe.yaml"
    return yaml.safe_load(recipe.read_text())["model"].get("task", "causal_lm") if recipe.is_file() else "causal_lm"


def merge(run_dir: str | Path, out: str | Path | None = None, dtype: str = "float32", check: bool = False) -> dict:
    """Merge a run's LoRA adapter into its base model and save safetensors + tokenizer (+ chat template) to ``out``
    (default RUN_DIR/merged). ``check`` compares the saved model's logits with base + adapter on sample inputs."""
    import shutil

    import torch
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from hf_tune.errors import HfTuneError

    run_dir = Path(run_dir)
    if not (run_dir / "adapter_config.json").is_file():
        raise HfTuneError(f"{run_dir}: no adapter_config.json: only a LoRA run has an adapter to merge\n"
                          "  fix: pass the output_dir of a run whose recipe has a lora section")
    if dtype not in MERGE_CHECK_TOLERANCE:
        raise HfTuneError(f"--dtype: {dtype!r} is not one of {sorted(MERGE_CHECK_TOLERANCE)}")
    out = Path(out) if out else run_dir / "merged"
    causal = _run_task(run_dir) == "causal_lm"
    peft_cls = AutoPeftModelForCausalLM if causal else AutoPeftModelForSequenceClassification
    model = peft_cls.from_pretrained(run_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    samples = _sample_inputs(tokenizer, causal)
    with torch.no_grad():
        reference = model(**samples).logits if check else None
    merged = model.merge_and_unload().to(getattr(torch, dtype))
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in ("recipe.yaml", "train_results.json", "eval_results.json", "all_results.json"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, out / name)
    result = {"merged_dir": str(out), "dtype": dtype}
    if check:
        reloaded = (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_pretrained(
            out, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (reloaded(**samples).logits - reference).abs().max().item()
        relative = diff / max(reference.abs().max().item(), 1e-12)
        result.update(max_abs_logit_diff=diff, relative_diff=relative, tolerance=MERGE_CHECK_TOLERANCE[dtype])
        if relative > MERGE_CHECK_TOLERANCE[dtype]:
            raise HfTuneError(f"merge check failed: max |Δ logit| = {diff:.3g} ({relative:.2e} of the largest logit) "
                              f"exceeds the {dtype} tolerance {MERGE_CHECK_TOLERANCE[dtype]:g}")
    return result


def _sample_inputs(tokenizer, causal: bool):
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 ="]
    if causal and tokenizer.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not causal)


def push(run_dir: str | Path, repo_id: str, merged: bool = False, private: bool = False,
         revision: str | None = None, token: str | None = None) -> str:
    """Create the repo if needed and upload the adapter (or, with ``merged``, the merged model), tokenizer, a
    README.md model card and the redacted recipe. Returns the commit URL. A failure leaves the run folder intact."""
    from huggingface_hub import HfApi, get_token

    from hf_tune.errors import HfTuneError
    from hf_tune.model_card import render_model_card

    run_dir = Path(run_dir)
    if not (run_dir / "recipe.yaml").is_file():
        raise HfTuneError(f"{run_dir}: not a run folder (no recipe.yaml)\n  fix: pass a training.output_dir")
    token = token or get_token()
    if not token:
        raise HfTuneError("no Hugging Face token: export HF_TOKEN=... (or `hf auth login`), then run the push again")
    folder = run_dir
    if merged:
        folder = run_dir / "merged"
        if not (folder / "config.json").is_file():
            merge(run_dir, folder)
    render_model_card(run_dir, repo_id, merged=merged).save(folder / "README.md")
    retry = f"hf-tune push {run_dir} --repo-id {repo_id}" + (" --merged" if merged else "") + \
        (" --private" if private else "") + (f" --revision {revision}" if revision else "")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(folder_path=folder, repo_id=repo_id, revision=revision,
                                   ignore_patterns=UPLOAD_IGNORE, commit_message="Upload with hf_tune")
    except Exception as err:  # network, auth, quota: the run itself is safe on disk
        raise HfTuneError(f"upload to {repo_id} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}\n"
                          f"  the run folder {run_dir} is intact; retry with: {retry}") from None
    return commit.commit_url
