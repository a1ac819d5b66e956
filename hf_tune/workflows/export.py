"""``hf-tune export``: a run as one GGUF file (llama.cpp, LM Studio) or GGUF + Modelfile (Ollama).

A LoRA run is merged by shard first (``hf-tune merge``, in float32, into a folder beside the output that is removed
afterwards); a full fine-tune's folder is read as it is. The GGUF carries the run's chat template and special tokens.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from hf_tune.catalog.export_formats import DEFAULT_EXPORT_FORMAT, DEFAULT_GGUF_QUANT, EXPORT_FORMATS, GGUF_QUANTS
from hf_tune.errors import HfTuneError
from hf_tune.model.embedded import locate_embedded
from hf_tune.model.ollama_template import modelfile, stop_strings, turn_parts
from hf_tune.records.run_reader import open_run

logger = logging.getLogger(__name__)
MODELFILE = "Modelfile"


def export(run_dir: str | Path, format: str = DEFAULT_EXPORT_FORMAT, quant: str = DEFAULT_GGUF_QUANT,
           out: str | Path | None = None) -> dict:
    """Write the run as GGUF to ``out`` (default ``RUN_DIR/gguf/model-QUANT.gguf``); ``format="ollama"`` also
    writes a ``Modelfile`` beside it. Returns what was written."""
    from transformers import AutoTokenizer

    from hf_tune.model.gguf_export import write_gguf

    if format not in EXPORT_FORMATS:
        raise HfTuneError(f"--format {format!r}: one of {', '.join(EXPORT_FORMATS)}")
    if quant not in GGUF_QUANTS:
        raise HfTuneError(f"--quant {quant!r}: one of {', '.join(GGUF_QUANTS)}")
    run = open_run(run_dir, needs=("tokenizer", "weights")).require_causal_lm("GGUF export writes")
    out = Path(out) if out else run.path / "gguf" / f"model-{quant}.gguf"
    if out.suffix != ".gguf":
        raise HfTuneError(f"--out {out}: name the GGUF file (ending in .gguf)")
    modelfile_text = None
    if EXPORT_FORMATS[format].modelfile:  # checked before the merge: a template Ollama cannot carry fails in seconds

        tokenizer = AutoTokenizer.from_pretrained(run.path)
        parts = turn_parts(tokenizer)
        modelfile_text = modelfile(parts, out.name, stop_strings(tokenizer, parts))
    model = run.recipe(required=False).get("model") or {}
    pre = base_pre_tokenizer(model.get("pretrained_model_name_or_path"), model.get("gguf_file"))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = None
    try:
        source = run.path
        if run.weights() == "adapter":
            from hf_tune.workflows.merge_run import merge

            staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.stem}-merge-"))
            source = Path(merge(run.path, out=staging / "merged", dtype="float32")["merged_dir"])
        written = write_gguf(source, out, quant, pre_tokenizer=pre, name=run.path.resolve().name)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    result = {"gguf": str(out), "architecture": written.architecture, "quant": quant, "tensors": written.tensors,
              "bytes": written.bytes, "pre_tokenizer": written.pre_tokenizer}
    if modelfile_text is not None:
        (out.parent / MODELFILE).write_text(modelfile_text)
        result["modelfile"] = str(out.parent / MODELFILE)
    return result


def base_pre_tokenizer(base: str | None, gguf_file: str | None) -> str | None:
    """llama.cpp's pre-tokenizer name where the base came as GGUF (an ``embedded:`` model, ``model.gguf_file``),
    read from that file; None otherwise."""
    import gguf

    path = None
    if base and base.startswith("embedded:"):

        _, spec, package = locate_embedded(base)
        path = package / spec.gguf_file if spec.gguf_file else None
    elif base and gguf_file and (Path(base).expanduser() / gguf_file).is_file():
        path = Path(base).expanduser() / gguf_file
    if path is None:
        return None
    field = gguf.GGUFReader(path).fields.get("tokenizer.ggml.pre")
    return field.contents() if field is not None else None
