"""``hf-tune export RUN_DIR``: a run as one GGUF file (llama.cpp, LM Studio) or GGUF + Modelfile (Ollama), a LoRA run
merged by shard first (``workflows/export.py``; the formats are ``catalog/export_formats.py``'s table)."""

from __future__ import annotations

from hf_tune.catalog.export_formats import DEFAULT_EXPORT_FORMAT, DEFAULT_GGUF_QUANT, EXPORT_FORMATS, GGUF_QUANTS
from hf_tune.commands.verb import RUN_DIR, Verb, option
from hf_tune.runtime.output_paths import Output, starts_with
from hf_tune.workflows.export import export


def run(args) -> None:
    result = export(args.run_dir, format=args.format, quant=args.quant, out=args.out)
    print(f"{result['gguf']}: {result['architecture']}, {result['quant']}, {result['tensors']} tensors, "
          f"{result['bytes'] / 2**20:,.1f} MiB")
    if "modelfile" in result:
        print(f"{result['modelfile']}: ollama create NAME -f {result['modelfile']}")


VERB = Verb(run, "write a run as one GGUF file (llama.cpp, LM Studio) or GGUF + Modelfile (Ollama); a LoRA run is "
            "merged by shard first", options=(
                RUN_DIR, option("--format", default=DEFAULT_EXPORT_FORMAT, choices=list(EXPORT_FORMATS),
                                help="; ".join(f"{fmt.name}: {fmt.summary}" for fmt in EXPORT_FORMATS.values())),
                option("--quant", default=DEFAULT_GGUF_QUANT, choices=list(GGUF_QUANTS), help="the 2-D weights' type "
                       f"(norms and biases stay float32; default {DEFAULT_GGUF_QUANT})"),
                option("--out", default=None, help="the .gguf file (default: RUN_DIR/gguf/model-QUANT.gguf; the "
                       "Modelfile goes beside it)")),
            output=Output("file", ours=starts_with(b"GGUF"), inputs=("run_dir",)))
