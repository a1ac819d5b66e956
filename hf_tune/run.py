"""``python -m hf_tune.run RECIPE [section.key=value ...]``: the same code under every launcher
(python, ``accelerate launch -m``, ``torchrun -m``, ``deepspeed --module``); ``hf-tune train`` runs it too."""

from __future__ import annotations

import hf_tune.commands.command_line  # noqa: F401  first: it settles progress bars before any library loads
from hf_tune.commands.train import main

if __name__ == "__main__":
    main()
