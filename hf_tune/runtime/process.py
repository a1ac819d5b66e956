"""The process-wide settings hf_tune makes where it is asked to run something (its entry points, ``train``), never
at ``import hf_tune``: a notebook that imports the package keeps its environment, loggers and warning filters as they
were (``tests/test_architecture.py`` imports it in a fresh interpreter and compares)."""

from __future__ import annotations

import logging
import os
import warnings


class _NotAboutTheRun(logging.Filter):
    """Drops a library's message that says nothing about the user's run, printed by every command or run that imports
    it: bitsandbytes' that the optional ``kernels`` package is missing (on any CPU with AVX512-BF16, at PEFT's import;
    bitsandbytes then runs its own CPU kernel, which tests/test_qlora.py trains on); DeepSpeed's "Setting accelerator
    to CPU" (transformers imports DeepSpeed wherever it is installed, so every CPU run printed it); lm-eval's three
    about how it was called when hf_tune scores the model in memory (``hf_tune.evaluation.harness``: an ``HFLM`` over
    a loaded model, one process, the shipped tasks, which take no ``--metadata``)."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in str(record.msg) for fragment in self.fragments)


_QUIETED = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "DeepSpeed": ("Setting accelerator to CPU",),
    "lm_eval.models.huggingface": ("`pretrained` model kwarg is not of type `str`",
                                   "Passed an already-initialized model through `pretrained`"),
    "lm_eval.api.task": ("Custom kwargs can be passed to `--metadata`",),
}


def settle_process() -> None:
    """Once per process (later calls change nothing):

    - ``MKL_CBWR=AUTO,STRICT`` unless the user set it: MKL's float32 kernels on CPUs with AVX-512 may sum in another
      order when a buffer sits at another address, so a resumed process (another allocation layout) drifted 1e-6 from
      the run it continues (a ZeRO-2 run killed and resumed on a Xeon with AMX). Conditional numerical
      reproducibility makes the sums depend on the data only. It takes effect where torch has run no matmul yet: the
      entry points call this before torch loads.
    - the library messages of ``_NotAboutTheRun`` dropped;
    - PEFT's call of transformers' deprecated ``is_gradient_checkpointing`` (a FutureWarning printed by every LoRA
      run and every adapter load) silenced.
    """
    os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
    for name, fragments in _QUIETED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NotAboutTheRun) for f in logger.filters):
            logger.addFilter(_NotAboutTheRun(*fragments))
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
