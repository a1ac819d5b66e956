"""Chat templates by name, for ``data.chat_template``: hf_tune's own (``chatml``) and the ones TRL ships (its
``trl/chat_templates/*.jinja``: each model family's original and its ``*_training`` variant), read as files, so a
base model without a template (or with one to replace) needs no Jinja of the user's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

OURS = Path(__file__).parent / "chat_templates"


def template_names() -> dict[str, Path]:
    """Every name ``data.chat_template`` takes, and its file (hf_tune's before TRL's of the same name)."""
    found = {}
    spec = importlib.util.find_spec("trl")  # located, not imported: reading a recipe loads no library
    if spec is not None and spec.submodule_search_locations:
        trl_dir = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
        found.update({path.stem: path for path in sorted(trl_dir.glob("*.jinja"))})
    found.update({path.stem: path for path in sorted(OURS.glob("*.jinja"))})
    return found


def names_a_template(value: str) -> bool:
    """Whether ``data.chat_template`` is a name rather than Jinja text or a file path."""
    return "{" not in value and "/" not in value and "\\" not in value and not value.endswith(".jinja") \
        and not Path(value).is_file()


def template_text(value: str) -> str:
    """The Jinja of ``data.chat_template``: the text itself, a named template's file, or the file at a path."""
    if "{" in value:
        return value
    if names_a_template(value):
        return template_names()[value].read_text(encoding="utf-8")
    return Path(value).read_text(encoding="utf-8")


def fitting_templates(model_type: str | None) -> list[str]:
    """The names that fit a base of ``model_type``: TRL's templates of its family (the ``*_training`` ones first:
    they mark the assistant's tokens), then ``chatml``, which fits any base (its markers become new tokens)."""
    family = (model_type or "").split("_")[0]
    names = [name for name in template_names() if family and name.startswith(family)]
    return sorted(names, key=lambda name: (not name.endswith("_training"), name)) + ["chatml"]


def folder_has_template(folder: Path) -> bool | None:
    """Whether a local tokenizer folder carries a chat template (None: no tokenizer files there to tell)."""
    import json

    config = folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    if not config.is_file():
        return None
    return bool(json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
