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
# Credentials in a URL, in any link of an fsspec chain (simplecache::s3://...): userinfo with a password
# (scheme://user:password@, whatever the password holds, "/" and "@" included: up to the last "@" of the word), and
# query values of secret-named keys (?X-Amz-Signature=..., &access_key=..., ?sas_token=...).
URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][\w+.-]*://)(?P<user>[^\s@/:]*):(?P<password>\S*)@")
URL_QUERY_SECRET = re.compile(r"(?P<key>[?&][^=&\s#]*(?:key|secret|token|password|signature|sig|credential)"
                              r"[^=&\s#]*=)(?P<value>[^&\s#]*)", re.IGNORECASE)
SECRET_FIX = ("keep tokens out of recipes: export HF_TOKEN=... or run `hf auth login` (W&B: WANDB_API_KEY or "
              "`wandb login`); the Hub client and the trackers read them from there")


def refuse_secrets(raw: Any, path: str = "", keys: bool = True) -> None:
    """A recipe holds no secret: it is saved in the run folder and uploaded, and Trainer pickles its arguments
    (``training_args.bin``, in every checkpoint). Any secret-named key with a value, or a token-shaped string, is an
    error. ``keys=False``: token-shaped values only (checked before the keys are, so that a mistyped key with "token"
    in its name is reported as the typo it is; the keys are checked once known)."""
    if isinstance(raw, dict):
        names_only = bool(NAME_MAPS.search(path.rsplit(".", 1)[-1]))
        for key, value in raw.items():
            dotted = f"{path}.{key}" if path else str(key)
            if keys and not names_only and is_secret_key(str(key)) and value not in (None, "", False):
                raise RecipeError(dotted, "holds a secret, which would be written into recipe.yaml, run.json and "
                                  "every checkpoint's training_args.bin", fix=SECRET_FIX)
            refuse_secrets(value, dotted, keys)
    elif isinstance(raw, (list, tuple)):
        for i, value in enumerate(raw):
            refuse_secrets(value, f"{path}[{i}]", keys)
    elif isinstance(raw, str) and TOKEN_VALUE.search(raw):
        raise RecipeError(path, "holds a token-shaped value (hf_... or sk-...)", fix=SECRET_FIX)


def is_secret_key(name: str) -> bool:
    """Whether a key's name says it holds a secret (token, password, api key, ...)."""
    return bool(SECRET_KEY.search(name))


def unknown_key(path: str, problem: str, suggestion: str | None) -> RecipeError:
    """The error of a key the section does not have: a typo with its "did you mean" (``data.batch_token``), except a
    secret-named key close to no key of ours (``model.token``, from_pretrained's), refused as the secret it holds."""
    if suggestion is None and is_secret_key(path.rsplit(".", 1)[-1]):
        return RecipeError(path, "holds a secret, which would be written into recipe.yaml, run.json and every "
                           "checkpoint's training_args.bin", fix=SECRET_FIX)
    return RecipeError(path, problem, fix=suggestion)


def url_has_credentials(url: str) -> bool:
    """Whether a URL (or an fsspec chain of them) carries a password in its userinfo or a secret in its query."""
    return bool(URL_USERINFO.search(url) or URL_QUERY_SECRET.search(url))


def redact_urls(text: str) -> str:
    """``text`` with every URL's password and secret query values replaced by '***' (the user name is kept)."""
    text = URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return URL_QUERY_SECRET.sub(lambda m: f"{m['key']}***", text)


def redact_secrets(value: Any) -> Any:
    """A copy with every value under a secret-looking key (token, password, api_key, ...) replaced by '***', and
    token-shaped strings (hf_..., sk-...) masked wherever they stand."""
    if isinstance(value, dict):
        return {k: "***" if SECRET_KEY.search(str(k)) and v not in (None, "", False) else redact_secrets(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_secrets(v) for v in value]
    return redact_urls(TOKEN_VALUE.sub("***", value)) if isinstance(value, str) else value
