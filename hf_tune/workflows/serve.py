"""``hf-tune serve``: an OpenAI-compatible server of a run, with the run's own chat template.

On a CUDA machine with vLLM installed it runs ``vllm serve``: the base with the run's adapter (``--enable-lora``), or
a full fine-tune's folder, or the merge of an adapter of fused parameters (a mixture of experts' experts, which vLLM's
LoRA does not load), named after the run folder. Elsewhere it runs transformers' own server (``transformers
serve``) on the merged model, named by its folder's path: a LoRA run is merged by shard once into ``RUN_DIR/merged``
(reused while newer than the adapter). Either way the tokenizer that renders each request is the one saved with the
run, so what was trained is what is served.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from hf_tune import run_folder
from hf_tune.errors import HfTuneError
from hf_tune.records.run_reader import ADAPTER_WEIGHTS, RunFolder, open_run

logger = logging.getLogger(__name__)


def served_folder(run: RunFolder) -> Path:
    """The folder transformers' server loads: a full fine-tune as it is, a LoRA run's merge."""
    if run.weights() == "model":
        return run.path
    merged = run.path / run_folder.MERGED
    adapter = next(run.path / name for name in ADAPTER_WEIGHTS if (run.path / name).is_file())
    config = merged / run_folder.MODEL_CONFIG
    if config.is_file() and config.stat().st_mtime >= adapter.stat().st_mtime:
        logger.info("Serving the merge already in %s", merged)
        return merged
    from hf_tune.workflows.merge_run import merge

    logger.info("Merging the adapter once into %s (hf-tune merge; reused by later serves)", merged)
    return Path(merge(run.path, out=merged)["merged_dir"])


def vllm_command(run: RunFolder, host: str, port: int) -> list[str]:
    """``vllm serve`` for the run: the base with the adapter as a LoRA module named after the run (rank allowed),
    or the full model; the run's chat template either way."""
    name = run.path.resolve().name
    template = run.path / "chat_template.jinja"
    command = ["vllm", "serve"]
    adapter = run.adapter_config()
    if adapter is not None and adapter.get("target_parameters"):
        # PEFT's adapters of fused parameters (a mixture of experts' expert tensors, hf_tune's default there): vLLM
        # loads their deltas nowhere or refuses them (vllm-project/vllm#41754, #40005), so it serves the merge
        logger.info("The adapter adapts %s, which vLLM's LoRA cannot load: serving the merge instead",
                    ", ".join(adapter["target_parameters"]))
        command += [str(served_folder(run)), "--served-model-name", name]
    elif adapter is not None:
        base, revision = run.adapter_base()
        command += [base, *(["--revision", revision] if revision else []), "--enable-lora", "--lora-modules",
                    f"{name}={run.path}",
                    "--max-lora-rank", str(max(16, int(adapter.get("r") or 16)))]
    else:
        command += [str(run.path), "--served-model-name", name]
    if template.is_file():
        command += ["--chat-template", str(template)]
    return command + ["--host", host, "--port", str(port)]


def serve(run_dir: str | Path, host: str = "127.0.0.1", port: int = 8000, device: str | None = None,
          dtype: str | None = None, block: bool = True):
    """Serve the run until interrupted (``block``), or return transformers' running ``Serve`` (stop it with
    ``kill_server()``) and the model name requests must use."""
    import torch

    from hf_tune.workflows.inference import default_device, default_dtype

    run = open_run(run_dir, needs=("tokenizer", "weights")).require_causal_lm("serve answers with")
    if block and torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        command = vllm_command(run, host, port)
        print(f"vLLM is installed: {' '.join(command)}", file=sys.stderr, flush=True)
        os.execvp(command[0], command)
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise HfTuneError("transformers' server needs fastapi, uvicorn and openai\n  fix: pip install "
                          "'hf_tune[serve]' (or, on a GPU, pip install vllm)")
    from transformers.cli.serve import Serve

    folder = served_folder(run)
    device = device or default_device()
    print(f"serving {run.path} at http://{host}:{port}/v1 as model {str(folder)!r} (transformers serve, {device})",
          file=sys.stderr, flush=True)
    server = Serve(force_model=str(folder), host=host, port=port, device=device, dtype=dtype or default_dtype(device),
                   non_blocking=not block)
    return server, str(folder)
