"""The export format table (``hf-tune export --format``) and the GGUF weight types (``--quant``): the command line's
choices and ``hf_tune.workflows.export`` read them. A new format is one entry here plus the code that writes it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ExportFormat:
    name: str
    summary: str  # one line, for the command's help
    modelfile: bool = False  # an Ollama Modelfile beside the GGUF file


EXPORT_FORMATS = {fmt.name: fmt for fmt in (
    ExportFormat("gguf", "one GGUF file (llama.cpp, LM Studio)"),
    ExportFormat("ollama", "a GGUF file and an Ollama Modelfile beside it", modelfile=True),
)}
DEFAULT_EXPORT_FORMAT = "gguf"
# the 2-D weights' GGUF type, by --quant (norms and biases stay float32): (GGMLQuantizationType, LlamaFileType) names
GGUF_QUANTS = {"f16": ("F16", "MOSTLY_F16"), "bf16": ("BF16", "MOSTLY_BF16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}
DEFAULT_GGUF_QUANT = "f16"
