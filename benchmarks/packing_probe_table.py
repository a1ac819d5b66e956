"""Which causal-LM architectures of the installed transformers pack padding-free, by hf_tune's packing probe.

Runs ``hf_tune.model.packing_probe`` (a tiny random model, two examples flattened into one row against each run
alone, under ``sdpa_varlen``) on every class of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that claims the
attention backend, plus the hybrid layouts of released checkpoints whose config defaults are all attention, and
writes the table into docs/speed.md ("Which architectures pack padding-free"). ``tests/test_packing_probe.py``
runs the same survey and checks every "packs" verdict independently.

    .venv/bin/python benchmarks/packing_probe_table.py            # print the table
    .venv/bin/python benchmarks/packing_probe_table.py --write    # and replace the section in docs/speed.md
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import textwrap
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "speed.md"
SECTION = "## Which architectures pack padding-free"
# Released checkpoints whose layout the config class's defaults do not show (their defaults are all attention):
# the layer kinds of LFM2-1.2B and LFM2-8B-A1B.
HYBRID_LAYOUTS = {
    "lfm2": {"full_attn_idxs": [2, 5, 8, 10, 12, 14]},
    "lfm2_moe": {"num_hidden_layers": 24, "num_dense_layers": 2,
                 "layer_types": ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]},
}


@dataclasses.dataclass
class Finding:
    """One architecture's verdict: ``packs``, or why not (``mixes``: the logits differed; else it did not run)."""

    model_type: str
    class_name: str
    layout: str  # "defaults" or the released layout probed
    packs: bool
    mixes: bool
    reason: str
    seconds: float
    model_class: type = dataclasses.field(repr=False, default=None)
    config: object = dataclasses.field(repr=False, default=None)


def causal_lm_classes() -> list[tuple[str, type | None, str]]:
    """(model type, class or None, why None) for every causal LM transformers maps."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            found.append((model_type, getattr(transformers, class_name), ""))
        except Exception as error:  # a class that needs another package
            found.append((model_type, None, f"{class_name}: {type(error).__name__}"))
    return found


def survey() -> tuple[list[Finding], list[tuple[str, str]]]:
    """The probe's verdict for every causal LM that claims the attention backend (and the hybrid layouts), and
    the model types left out (off the attention interface, or not importable), each with its reason."""
    import hf_tune.model.attention  # noqa: F401  (registers sdpa_varlen)
    from hf_tune.model.attention import NAME
    from hf_tune.model.packing_probe import probe_padding_free

    findings, left_out = [], []
    for model_type, model_class, why in causal_lm_classes():
        if model_class is None:
            left_out.append((model_type, f"not importable here ({why.split(':')[1].strip()})"))
            continue
        if not getattr(model_class, "_supports_attention_backend", False):
            left_out.append((model_type, "off transformers' attention interface"))
            continue
        layouts = {"defaults": None}
        if model_type in HYBRID_LAYOUTS:
            layouts["released hybrid layout"] = HYBRID_LAYOUTS[model_type]
        for layout, overrides in layouts.items():
            try:
                config = model_class.config_class(**(overrides or {}))
            except Exception as error:
                findings.append(Finding(model_type, model_class.__name__, layout, False, False,
                                        f"no config: {type(error).__name__}: {error}"[:200], 0.0, model_class))
                continue
            started = time.perf_counter()
            result = probe_padding_free(model_class, NAME, True, config)
            findings.append(Finding(model_type, model_class.__name__, layout, result.packs,
                                    result.max_difference is not None and not result.packs,
                                    result.reason, time.perf_counter() - started, model_class, config))
    return findings, left_out


def table(findings: list[Finding], left_out: list[tuple[str, str]]) -> str:
    """The docs section: a Markdown table, one row per architecture and layout."""
    import transformers

    packs = sum(f.packs for f in findings)
    mixes = [f for f in findings if f.mixes]
    lead = (
        "Padding-free batches are exact only where no layer mixes the flattened examples. Attention on "
        "transformers' attention interface runs each example apart, but the convolution, state-space and "
        "linear-attention layers of hybrid models read across the boundary, so a flattened example's logits change. "
        "hf_tune decides by proof, not by the class's `_supports_attention_backend` flag "
        "(`hf_tune/model/packing_probe.py`): when the model loads and when the collator is built, it shrinks the "
        "model's own config (one layer of each kind that `layer_types` and its kin declare; widths of 64, 4 experts, "
        "a 256-token vocabulary; weights drawn at std 0.1 so that a leak shows), builds it randomly initialised on "
        "the CPU in float32 with the attention the run uses, and runs two examples flattened into one row (restarting "
        "`position_ids`, `cu_seq_lens`, as the collator builds them) and each alone. Only where the logits agree "
        "within 1e-4 of the largest logit (float32 noise stays under 1e-5; leaks measure 1e-2 to 1) is `sdpa_varlen` "
        "the default and are batches flattened; elsewhere they stay padded and the reason is logged. The verdict is "
        "kept for the process, per model class, transformers version, attention and shrunk config. It costs "
        "0.04-0.06 s for Llama, Qwen3, Mistral and Gemma 3 in a fresh process on this 2-core CPU, 0.5 s for "
        "Qwen3-MoE (whose depth is kept: its sparse layers follow a step), up to about 10 s (Gemma 3n, whose 35 "
        "layers are kept). Flash attention "
        "and Hub kernels are probed as `sdpa_varlen`, which runs examples apart from the same `cu_seq_lens`. "
        "An explicit `data.padding_free: true` is obeyed as written.")
    found = (
        f"Generated by `benchmarks/packing_probe_table.py --write` with transformers {transformers.__version__}: "
        f"of {len(findings)} causal-LM architectures and layouts that claim transformers' attention backend, "
        f"{packs} pack padding-free; {len(mixes)} mix flattened examples in a layer (hybrids, and bidirectional "
        "encoders used as decoders); the rest could not be built tiny on the CPU or run `sdpa_varlen` (a softcap, "
        "attention sinks) and keep padded batches. `tests/test_packing_probe.py` checks every \"yes\" again with "
        "hf_tune's collator, other examples and other weights. \"defaults\": the config class's defaults; "
        "\"released hybrid layout\": the layer kinds of released checkpoints, where the defaults are all attention "
        "(the probe reads the user's own config, so these are what LFM2 users get).")
    lines = [SECTION, "", *textwrap.wrap(lead, 118), "", *textwrap.wrap(found, 118), "",
             "| model type | class | layout | packs padding-free | why |", "|---|---|---|---|---|"]
    for f in findings:
        verdict = "yes" if f.packs else "no: layers mix examples" if f.mixes else "no: not probed"
        why = re.sub(r"\s+", " ", f.reason).replace("|", "/")[:160]
        lines.append(f"| {f.model_type} | {f.class_name} | {f.layout} | {verdict} | {why} |")
    for why in sorted({why for _, why in left_out}):
        names = [model_type for model_type, reason in left_out if reason == why]
        lines += ["", *textwrap.wrap(f"Not probed, never flattened by default: {why} ({len(names)}): "
                                     + ", ".join(names) + ".", 118)]
    return "\n".join(lines) + "\n"


def write_section(text: str, path: Path = DOCS) -> None:
    """Replace the section (up to the next ``## `` heading) in ``path``, or append it."""
    docs = path.read_text()
    start = docs.find(SECTION)
    if start < 0:
        path.write_text(docs.rstrip("\n") + "\n\n" + text)
        return
    end = docs.find("\n## ", start + len(SECTION))
    path.write_text(docs[:start] + text + (docs[end + 1:] if end >= 0 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the section in {DOCS}")
    args = parser.parse_args()
    logging.getLogger("hf_tune").setLevel(logging.ERROR)  # the verdicts are the table
    import transformers

    transformers.logging.set_verbosity_error()
    findings, left_out = survey()
    text = table(findings, left_out)
    print(text)
    common = [f.seconds for f in findings if f.model_type in ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")]
    print(f"probe seconds: common architectures max {max(common):.3f}, all max {max(f.seconds for f in findings):.2f}")
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
