"""The README.md model card of a run: Hub metadata (``huggingface_hub.ModelCardData``) and a body written from the
run folder (resolved recipe, metrics). Secrets never reach it: the run's recipe.yaml is already redacted."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData

from hf_tune import run_folder
from hf_tune.catalog.formats import DEFAULT_FORMAT
from hf_tune.catalog.methods import method_of
from hf_tune.catalog.sources import LOCAL_DATA_SUFFIXES, PACKAGED_BUILDERS, looks_like_local_path
from hf_tune.catalog.tasks import Task, task_of
from hf_tune.model.embedded import PREFIX
from hf_tune.records.lineage import (
    base_model_id,  # noqa: F401  (hub.py's and the tests' import)
    package_version,
    read_lineage,
)
from hf_tune.records.lineage import embedded_spec as _embedded
from hf_tune.redaction import redact_secrets

VERSIONS = ("hf_tune", "transformers", "peft", "torch", "datasets", "accelerate")
HUB = "https://huggingface.co"


def _hub_datasets(data: dict) -> list[str]:
    sources = [*_sources(data.get("train")), *_sources(data.get("eval"))]
    return sorted({s["path"] for s in sources if s.get("path") and s["path"] not in PACKAGED_BUILDERS
                   and Path(s["path"]).suffix not in LOCAL_DATA_SUFFIXES and not looks_like_local_path(s["path"])})


def _sources(split: dict | list | None) -> list[dict]:
    """The sources of a ``data.train`` / ``data.eval``: one, or a mixture's list of them."""
    return [s for s in (split if isinstance(split, list) else [split]) if isinstance(s, dict)]


def _paths(split: dict | list | None) -> str:
    """``path`` + ``path`` of a split's sources, each with its mixture weight where it has one."""
    return " + ".join(f"`{s.get('path', '?')}`" + (f" (weight {s['weight']})" if "weight" in s else "")
                      for s in _sources(split)) or "`?`"


def _training_data(data: dict, max_length) -> str:
    """Where the training data came from: a source, or a mixture's sources with their weights."""
    mixture = " (a mixture)" if len(_sources(data.get("train"))) > 1 else ""
    return (f"{_paths(data.get('train'))}{mixture} in the `{data.get('format', DEFAULT_FORMAT)}` format, up to "
            f"{max_length} tokens per example")


def render_model_card(run_dir: str | Path, repo_id: str, merged: bool = False,
                      base_model: str | None = None, local: bool = False) -> ModelCard:
    """The card of a push. ``base_model`` is the Hub id named at push time for a run trained on a local folder.
    ``local``: the card of the run folder itself (its ``README.md``, written at the end of training), ``repo_id``
    its path: the adapter there names the base as the recipe does, and loads with ``hf_tune.load_model``."""
    run_dir = Path(run_dir)
    recipe = redact_secrets(yaml.safe_load((run_dir / run_folder.RECIPE).read_text()))
    model, training, data = recipe["model"], recipe.get("training", {}), recipe.get("data", {})
    lora = recipe.get("lora") is not None and not merged
    task = task_of(model.get("task"))
    base = base_model or base_model_id(model["pretrained_model_name_or_path"])
    lineage = read_lineage(run_dir) if (run_dir / run_folder.MANIFEST).is_file() else None  # what run.json says
    metrics = {}
    for name in (run_folder.TRAIN_RESULTS, run_folder.EVAL_RESULTS):
        if (run_dir / name).is_file():
            metrics.update(json.loads((run_dir / name).read_text()))
    method = method_of(recipe.get("method"))
    tags = ["hf_tune", *(["lora"] if recipe.get("lora") is not None else []),
            *(["trl", method.name] if method.uses_trl else []), *recipe.get("hub", {}).get("tags", [])]
    card_data = ModelCardData(
        base_model=base, library_name="peft" if lora else "transformers", license=recipe.get("hub", {}).get("license"),
        datasets=_hub_datasets(data) or None, tags=tags, pipeline_tag=task.pipeline_tag,
    )
    hyper = {k: training[k] for k in ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
                                      "gradient_accumulation_steps", "warmup_steps", "weight_decay",
                                      "lr_scheduler_type", "optim", "seed", "beta", "loss_type", "max_length",
                                      "num_generations", "max_completion_length") if k in training}
    if recipe.get("rewards"):
        hyper["rewards"] = recipe["rewards"]
    if recipe.get("teacher"):
        hyper["teacher"] = recipe["teacher"]["pretrained_model_name_or_path"]
    hyper.update({f"lora.{k}": v for k, v in (recipe.get("lora") or {}).items()})
    hyper.update({f"optim.{k}": v for k, v in recipe.get("optim", {}).items()})
    body = [
        f"# {repo_id.split('/')[-1]}", "",
        f"{'A LoRA adapter for' if lora else 'A fine-tune of'} {f'`{base}`' if base else 'a local base model'}"
        f"{' (merged into the base weights)' if merged else ''}, trained with "
        f"[hf_tune](https://pypi.org/project/hf-tune/) for {task.name.replace('_', ' ')}"
        + (f", by {method.title} ({method.summary})." if method.uses_trl else "."), "",
        *_base_lines(model["pretrained_model_name_or_path"], base, given=bool(base_model), lora=lora and not local,
                     repo_id=repo_id),
        "## Training data", "",
        _training_data(data, training.get("max_length") if method.uses_trl else data.get("max_length"))
        + (f"; evaluation on {_paths(data['eval'])}." if data.get("eval") else
           f"; {data['eval_split']:.0%} held out for evaluation." if data.get("eval_split") else "."), "",
        "## Hyperparameters", "", "| key | value |", "|---|---|",
        *[f"| {k} | {v} |" for k, v in hyper.items()], "",
        "## Results", "", "| metric | value |", "|---|---|",
        *[f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in sorted(metrics.items())], "",
        "## Usage", "", "```python", *_usage(repo_id, lora, task, run_class_labels(run_dir), local), "```", "",
        "## Reproduce", "", "Save the recipe below as `recipe.yaml`, then:", "", "```bash",
        "pip install 'hf_tune[all]'", "accelerate launch -m hf_tune.run recipe.yaml", "```", "",
        "```yaml", yaml.safe_dump(recipe, sort_keys=False).rstrip(), "```", "",
        *_lineage_lines(lineage),
        "## Framework versions", "",
        *[f"- {name} {(lineage or {}).get('packages', {}).get(name) or package_version(name, 'unknown')}"
          for name in VERSIONS], "",
    ]
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(body))


def _lineage_lines(lineage: dict | None) -> list[str]:
    """The run's lineage (``hf_tune.records.lineage``): base model, data fingerprints, code commit."""
    if not lineage:
        return []
    base, git = lineage.get("base_model") or {}, lineage.get("git") or {}
    lines = ["## Lineage", "", "| field | value |", "|---|---|"]
    lines += [f"| base_model.{k} | `{v}` |" for k, v in base.items()]
    lines += [f"| datasets.{name}.fingerprint | `{d['fingerprint']}` ({d['examples']} examples) |"
              for name, d in (lineage.get("datasets") or {}).items()]
    if git.get("commit"):
        lines.append(f"| git.commit | `{git['commit']}`{' (uncommitted changes)' if git.get('dirty') else ''} |")
    return [*lines, ""]


def _base_lines(name: str, base: str | None, given: bool, lora: bool, repo_id: str) -> list[str]:
    """Which weights the run trained on, where the card's base model alone does not say it."""
    if given:
        return ["## Base model", "", f"`{base}` was named as the base model when the run was pushed (`--base-model`); "
                "hf_tune could not check that it holds the weights the run trained on.", ""]
    spec = _embedded(name) if name.startswith(PREFIX) else None
    if spec is None:
        return []
    package = f"the PyPI package `{spec.distribution}` {package_version(spec.distribution, 'unknown')}"
    if not spec.gguf_file:
        return ["## Base model", "", f"Trained on the copy of `{base}` shipped in {package}.", ""]
    lines = ["## Base model", "",
             f"Trained on the weights shipped in {package}: the GGUF file `{spec.gguf_file}` (sha256 "
             f"`{spec.gguf_sha256}`), quantized {spec.gguf_quantization}, dequantized to float32 by transformers "
             f"before training. The package's description links this file to "
             f"[`{spec.gguf_repo}`]({HUB}/{spec.gguf_repo}/blob/{spec.gguf_revision}/{spec.gguf_file}) at revision "
             f"`{spec.gguf_revision}`, a quantization of `{base}`.", ""]
    if lora:
        lines += [f"The adapter names `{base}` as its base, so `from_pretrained` below applies it to the Hub's "
                  f"full-precision weights, not to the {spec.gguf_quantization.split()[0]}-dequantized weights it was "
                  "trained against. The logit difference between the two bases was not measured. To apply it to the "
                  "exact training weights:", "",
                  "```python",
                  f"from hf_tune.model.embedded import embedded_model_path  # pip install 'hf_tune[embedded]'; "
                  f"pip install --no-deps {spec.distribution}", "from peft import PeftModel",
                  "from transformers import AutoModelForCausalLM", "",
                  f"base = AutoModelForCausalLM.from_pretrained(embedded_model_path({name!r}))",
                  f"model = PeftModel.from_pretrained(base, {repo_id!r})", "```", ""]
    return lines


def run_class_labels(run_dir: Path) -> dict[int, str] | None:
    """id2label of a classifier run's head: its config.json (a full fine-tune) or class_labels.json (a LoRA run,
    whose adapter alone does not name the classes); None for a run without either."""
    for name in (run_folder.CLASS_LABELS, run_folder.MODEL_CONFIG):
        if (run_dir / name).is_file():
            labels = json.loads((run_dir / name).read_text()).get("id2label")
            if labels:
                return {int(i): label for i, label in labels.items()}
    return None


def _usage(repo_id: str, lora: bool, task: Task, labels: dict[int, str] | None, local: bool = False) -> list[str]:
    """Loading the pushed model and its processor (``Task.processor``: tokenizer, image processor or processor); an
    adapter of a classifier builds the base with the trained head's classes, which the base's head may not have.
    ``local``: the run folder's own card, whose adapter loads with ``hf_tune.load_model``."""
    auto, peft_auto, processor = task.auto_class, task.peft_auto_class, task.processor
    head = f", id2label={labels!r}, ignore_mismatched_sizes=True" if lora and labels else ""
    if lora and local:
        lines = ["from hf_tune import load_model  # the adapter on its base, an embedded: base resolved",
                 f"from transformers import {processor}", "", f"model = load_model({repo_id!r}{head})"]
    elif lora:
        lines = [f"from peft import {peft_auto}", f"from transformers import {processor}", "",
                 f"model = {peft_auto}.from_pretrained({repo_id!r}{head})"]
    else:
        lines = [f"from transformers import {auto}, {processor}", "", f"model = {auto}.from_pretrained({repo_id!r})"]
    lines.append(f"{'tokenizer' if task.reads_text else 'processor'} = {processor}.from_pretrained({repo_id!r})")
    if task.causal:
        lines += ['messages = [{"role": "user", "content": "Hello!"}]',
                  "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
                  "return_dict=True)",
                  "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0]))"]
    return lines
