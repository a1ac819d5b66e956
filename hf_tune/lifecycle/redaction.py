"""Secrets never reach a file: recipes holding one are refused, and what is written is redacted once more."""

from __future__ import annotations

import re
from typing import Any

from hf_tune.errors import RecipeError

# Token shapes: Hugging Face user tokens are hf_ and 34 letters or digits, OpenAI-style keys sk- and 20 or more. Shorter
# runs ("runs/hf_finetuning") are names, not tokens.
TOKEN_VALUE = re.compile(r"(?<![/\w])(hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,})\b")
# Keys whose values are module names, not settings (peft's rank_pattern / alpha_pattern map names such as BERT's
# "key" projection to values): the secret-key rule does not look inside them.
NAME_MAPS = re.compile(r"_pattern$")
SECRET_KEY = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|key|credentials?)$", re.IGNORECASE)
SECRET_FIX = ("keep tokens out of recipes: export HF_TOKEN=... or run `hf auth login` (W&B: WANDB_API_KEY or "
              "`wandb login`); the Hub client and the trackers read them from there")


def refuse_secrets(raw: Any, path: str = "") -> None:
    """A recipe holds no secret: it is saved in the run folder and uploaded, and Trainer pickles its arguments
    (``training_args.bin``, in every checkpoint). Any secret-named key with a value, or a token-shaped string, is an
    error."""
    if isinstance(raw, dict):
        names_only = bool(NAME_MAPS.search(path.rsplit(".", 1)[-1]))
        for key, value in raw.items():
            dotted = f"{path}.{key}" if path else str(key)
            if not names_only and SECRET_KEY.search(str(key)) and value not in (None, "", False):
                raise RecipeError(dotted, "holds a secret, which would be written into recipe.yaml, run.json and "
                                  "every checkpoint's training_args.bin", fix=SECRET_FIX)
            refuse_secrets(value, dotted)
    elif isinstance(raw, (list, tuple)):
        for i, value in enumerate(raw):
            refuse_secrets(value, f"{path}[{i}]")
    elif isinstance(raw, str) and TOKEN_VALUE.search(raw):
        raise RecipeError(path, "holds a token-shaped value (hf_... or sk-...)", fix=SECRET_FIX)


def redact_secrets(value: Any) -> Any:
    """A copy with every value under a secret-looking key (token, password, api_key, ...) replaced by '***', and
    token-shaped strings (hf_..., sk-...) masked wherever they stand."""
    if isinstance(value, dict):
        return {k: "***" if SECRET_KEY.search(str(k)) and v not in (None, "", False) else redact_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v) for v in value]
    return TOKEN_VALUE.sub("***", value) if isinstance(value, str) else value
