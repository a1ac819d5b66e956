"""``python -m hf_tune.run RECIPE [section.key=value ...]``: the same code under every launcher
(python, ``accelerate launch -m``, ``torchrun -m``, ``deepspeed --module``); ``hf-tune train`` runs it too."""

from __future__ import annotations

from hf_tune.commands.command_line import plain_progress_off_a_terminal
from hf_tune.runtime.process import settle_process

plain_progress_off_a_terminal()  # before the libraries below load: tqdm reads it at its import
settle_process()  # before torch loads: MKL reads MKL_CBWR at its first call

from hf_tune.commands.train import main  # noqa: E402

if __name__ == "__main__":
    main()
