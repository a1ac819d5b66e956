"""The base of hf_tune's own recipe sections."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of our own keys: an unknown key is refused (with a "did you mean"), an assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
