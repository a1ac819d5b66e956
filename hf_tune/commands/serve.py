"""``hf-tune serve RUN_DIR``: an OpenAI-compatible server of a run with its own chat template
(``workflows/serve.py``: vLLM on a GPU where installed, else transformers serve on the merged model)."""

from __future__ import annotations

from hf_tune.commands.option_types import whole
from hf_tune.commands.verb import DEVICE, DTYPE, RUN_DIR, Verb, option
from hf_tune.workflows.serve import serve


def run(args) -> None:
    serve(args.run_dir, host=args.host, port=args.port, device=args.device, dtype=args.dtype)


VERB = Verb(run, "an OpenAI-compatible server of a run (vLLM with the adapter where installed on a GPU, else "
            "transformers serve on the merged model)", options=(
                RUN_DIR, option("--host", default="127.0.0.1"), option("--port", type=whole(1, 65535), default=8000),
                DEVICE, DTYPE))
