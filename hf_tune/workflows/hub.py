"""The Hugging Face Hub: pushing a run with its model card (a merged one through ``hf_tune.workflows.merge_run``)."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from huggingface_hub import constants  # noqa: F401  (tests and users patch hf_tune.workflows.hub.constants)

from hf_tune import run_folder
from hf_tune.catalog.trackers import tracker_files
from hf_tune.errors import HfTuneError
from hf_tune.records.model_card import base_model_id, render_model_card
from hf_tune.records.run_reader import open_run
from hf_tune.runtime.network import hub_is_reachable  # noqa: F401  (hf_tune.workflows.hub.hub_is_reachable, as before)
from hf_tune.workflows.merge_run import merge, recipe_model, run_task  # noqa: F401  run_task: hub's, as before

logger = logging.getLogger(__name__)


# What a push uploads, by name: an allow-list, so that a file that Trainer or a tracker adds to the run folder stays
# private until it is named here. Weights and tokenizer come from the run folder (or RUN_DIR/merged), the rest from
# the run folder; README.md and adapter_config.json are written for the upload, never into the run folder.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_config.json", "config.json", "generation_config.json",
                "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "additional_chat_templates/*.jinja",
                   "preprocessor_config.json", "processor_config.json")  # an image processor, a VLM's processor
RESULT_FILES = (run_folder.RECIPE, run_folder.TRAIN_RESULTS, run_folder.EVAL_RESULTS, run_folder.ALL_RESULTS,
                run_folder.CLASS_LABELS)
# only with include_manifest: host, command line, env
MANIFEST_FILES = (run_folder.MANIFEST, run_folder.TRAINER_STATE, "*.png")
TRACKER_LOGS = tracker_files("logs")  # only with include_logs: each tracker's folder (hf_tune.catalog.trackers)
def push(run_dir: str | Path, repo_id: str, merged: bool = False, private: bool = False,
         revision: str | None = None, token: str | None = None, base_model: str | None = None,
         include_manifest: bool = False, include_logs: bool = False) -> str:
    """Create the repo if needed and upload what a model repo needs (see ``upload_plan``): the adapter (or, with
    ``merged``, the merged model), tokenizer, a README.md model card, the redacted recipe and the results. The uploaded
    adapter_config.json names the base by its Hub id (``base_model`` for a run trained on a local folder). The run
    folder is only read: a merge it lacks is made in a temporary folder. Returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi, get_token

    run = open_run(run_dir, needs=("recipe", "weights", "tokenizer"))
    run_dir = run.path
    token = token or get_token()
    if not token:
        raise HfTuneError("no Hugging Face token: export HF_TOKEN=... (or `hf auth login`), then run the push again")
    adapter = not merged and run.weights() == "adapter"
    base, base_revision = pushed_base(run_dir, base_model, adapter)
    flags = {"--merged": merged, "--private": private, f"--revision {revision}": revision,
             f"--base-model {base_model}": base_model, "--include-manifest": include_manifest,
             "--include-logs": include_logs}
    retry = " ".join([f"hf-tune push {run_dir} --repo-id {repo_id}", *(flag for flag, given in flags.items() if given)])
    with tempfile.TemporaryDirectory(prefix="hf_tune-push-") as staging:
        weights_dir = run_dir / run_folder.MERGED if merged else run_dir
        if merged and not (weights_dir / run_folder.MODEL_CONFIG).is_file():
            weights_dir = Path(merge(run_dir, Path(staging) / run_folder.MERGED)["merged_dir"])
        written = {"README.md": str(render_model_card(run_dir, repo_id, merged=merged, base_model=base_model)).encode()}
        if adapter:
            config = dict(run.adapter_config())
            config.update(base_model_name_or_path=base, revision=base_revision)
            written[run_folder.ADAPTER_CONFIG] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        files = {**upload_plan(run_dir, weights_dir, include_manifest, include_logs), **written}
        operations = [CommitOperationAdd(path, content) for path, content in sorted(files.items())]
        api = HfApi(token=token)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision:
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            commit = api.create_commit(repo_id, operations, revision=revision, commit_message="Upload with hf_tune")
        except Exception as err:  # network, auth, quota: the run itself is safe on disk
            first_line = str(err).splitlines()[0] if str(err) else ""
            raise HfTuneError(f"upload to {repo_id} failed: {type(err).__name__}: {first_line}\n"
                              f"  the run folder {run_dir} is unchanged; retry with: {retry}") from None
    return commit.commit_url


def upload_plan(run_dir: Path, weights_dir: Path, include_manifest: bool = False,
                include_logs: bool = False) -> dict[str, Path]:
    """{path in the repo: file} of what a push uploads: weights and tokenizer from ``weights_dir``, the redacted
    recipe and results from ``run_dir``, and the manifest or the tracker logs only when asked for. Never the
    checkpoints, training_args.bin (a pickle) or anything not named in the lists above."""
    plan: dict[str, Path] = {}

    def add(folder: Path, patterns, links: bool = True) -> None:
        for pattern in patterns:
            for path in sorted(folder.glob(pattern)):
                parts = path.relative_to(folder).parts
                linked = any(folder.joinpath(*parts[:i]).is_symlink() for i in range(1, len(parts) + 1))
                if path.is_file() and (links or not linked):
                    plan["/".join(parts)] = path

    add(weights_dir, WEIGHT_FILES + TOKENIZER_FILES)
    add(run_dir, RESULT_FILES)
    if include_manifest:
        add(run_dir, MANIFEST_FILES)
    if include_logs:  # W&B links latest-run and debug.log to files it already holds: each is uploaded once
        add(run_dir, [f"{name}/**/*" for name in TRACKER_LOGS], links=False)
    return plan


def pushed_base(run_dir: Path, base_model: str | None, adapter: bool) -> tuple[str | None, str | None]:
    """(Hub id, revision) of the base model that the upload names: ``base_model`` if given, else the recipe's Hub id
    (an embedded model's is the Hub id its weights came from). An adapter whose base others cannot load is refused."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if base_model:
        try:
            validate_repo_id(base_model)
        except HFValidationError:
            raise HfTuneError(f"--base-model: {base_model!r} is not a Hub id\n  fix: name the base model as ORG/NAME, "
                              "the Hub id that others load it by") from None
        return base_model, None
    model = recipe_model(run_dir)
    name = model.get("pretrained_model_name_or_path") or ""
    base = base_model_id(name)
    if adapter and (base is None or model.get("gguf_file")):
        what = f"the GGUF file {model['gguf_file']} in {name}" if base else f"the local folder {name}"
        raise HfTuneError(f"{run_dir}: the adapter's base model is {what}, which others cannot load with the adapter "
                          "alone\n  fix: push the merged model with --merged, or name the base model's Hub id with "
                          "--base-model ORG/NAME")
    return base, None if name.startswith("embedded:") else model.get("revision")
