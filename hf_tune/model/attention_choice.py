"""The attention a causal LM runs when the recipe names none, decided once in ``build_model`` and logged.

On a CUDA GPU, flash attention where it is installed: the ``flash_attn`` packages (FA3 on Hopper, else FA2), or a
flash kernel from the Hub that the ``kernels`` package has already put in the local cache (nothing is downloaded:
the cached commit is named). Everywhere else, and for a run that computes in float32 (flash attention needs bf16 or
fp16), ``sdpa_varlen``. Both run each example of a flattened row apart, so padding-free packs stay exact.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from hf_tune.model.attention import NAME as SDPA_VARLEN

logger = logging.getLogger(__name__)


def flash_candidates(capability: tuple[int, int]) -> list[str]:
    """Flash attention implementations usable on a CUDA card of this compute capability, best first."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    names = []
    if capability[0] == 9 and is_flash_attn_3_available():  # FA3's kernels are Hopper's only
        names.append("flash_attention_3")
    if capability >= (8, 0) and is_flash_attn_2_available():  # FA2: Ampere and later
        names.append("flash_attention_2")
    return names + cached_hub_flash_kernels(capability)


def cached_hub_flash_kernels(capability: tuple[int, int], cache: Path | None = None) -> list[str]:
    """``repo@commit`` of transformers' flash kernels from the Hub found in the local cache (``kernels`` installed),
    for ``attn_implementation``: a named commit loads from the cache without resolving a version online."""
    if importlib.util.find_spec("kernels") is None or capability < (8, 0):
        return []
    from transformers.modeling_flash_attention_utils import FLASH_ATTN_KERNEL_FALLBACK

    repos = [FLASH_ATTN_KERNEL_FALLBACK["flash_attention_2"]]
    if capability[0] == 9:
        repos.insert(0, FLASH_ATTN_KERNEL_FALLBACK["flash_attention_3"])
    found = []
    for repo in repos:
        commit = cached_kernel_commit(repo, cache)
        if commit:
            found.append(f"{repo}@{commit}")
    return found


def cached_kernel_commit(repo: str, cache: Path | None = None) -> str | None:
    """The commit of the newest cached snapshot of a Hub kernel repository that holds a build, or None."""
    if cache is None:
        from huggingface_hub.constants import HF_HUB_CACHE

        cache = Path(os.environ.get("KERNELS_CACHE") or HF_HUB_CACHE)
    snapshots = Path(cache) / f"models--{repo.replace('/', '--')}" / "snapshots"
    builds = sorted(snapshots.glob("*/build/*/*/__init__.py"), key=lambda path: path.stat().st_mtime, reverse=True)
    return builds[0].relative_to(snapshots).parts[0] if builds else None


def apply_attention(model, decided: str) -> tuple[str, str | None]:
    """Set the attention ``decide`` chose on a loaded model; (what runs, why it is not the decision, or None). Only
    flash attention may fail to load (a broken or mismatched build): then ``sdpa_varlen``, which also runs flattened
    examples apart."""
    if "flash" in decided:
        try:
            model.set_attn_implementation(decided)
            logger.info("Attention: %s (installed)", decided)
            return decided, None
        except (ImportError, ValueError, OSError, RuntimeError) as err:
            why = f"flash attention failed to load: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            model.set_attn_implementation(SDPA_VARLEN)
            return SDPA_VARLEN, why
    model.set_attn_implementation(decided)
    if decided == SDPA_VARLEN:
        logger.info("Attention: %s (transformers' SDPA with each flattened example apart)", SDPA_VARLEN)
    return decided, None
