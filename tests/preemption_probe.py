"""``python tests/preemption_probe.py RECIPE STEP SIGNAL RANK`` (alone, or under torchrun / deepspeed): what
``python -m hf_tune.run RECIPE`` does, plus a callback that sends SIGNAL (TERM, USR1) to this process as optimizer step
STEP begins, on rank RANK only: a preemption at a known step, no sleep. Each rank writes the status it exits with to
``output_dir/exit-rank<R>.json`` (a launcher reports only its own)."""

import json
import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

from hf_tune.assembly.loading import load_recipe
from hf_tune.commands.command_line import configure_logging, user_errors
from hf_tune.workflows.train import train

recipe_path, step, signal_name, signalled_rank = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])


class SignalAt(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == step and args.process_index == signalled_rank:
            os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))


configure_logging()
recipe = load_recipe(recipe_path)
rank = int(os.environ.get("RANK", "0"))
exit_file = Path(recipe.training["output_dir"]) / f"exit-rank{rank}.json"
status = 0
try:
    with user_errors(debug=False):
        train(recipe, callbacks=[SignalAt()])
except SystemExit as stop:
    status = stop.code
    raise
finally:
    exit_file.write_text(json.dumps({"status": status}))
