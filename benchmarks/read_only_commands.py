"""How long the verbs that only read take, end to end as a user runs them: ``hf-tune --help``, ``validate``,
``report`` and ``compare`` of two run folders. The folders are trained first (two tiny runs of the embedded
SmolLM2's tokenizer on a random 2-layer Llama, 4 steps each), then each verb runs ``--runs`` times, alternated,
and the median is printed; with ``--imports`` the heavy modules each verb imports (torch, transformers, peft,
...) are listed too. ``--against REV`` runs every verb also with the package of an older commit (a git worktree,
first on ``PYTHONPATH``), alternated with this tree's, for a ratio measured side by side.

    python benchmarks/read_only_commands.py [--runs 5] [--imports] [--against REV]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "datasets")


def train_two_runs(scratch: Path) -> list[Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import chat_recipe, save_tiny_llama
    from transformers import AutoTokenizer

    from hf_tune import load_recipe, train
    from hf_tune.model.embedded import embedded_model_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path("SmolLM2-135M-Instruct"))
    model = save_tiny_llama(scratch / "tiny", tokenizer)
    runs = []
    for lr in (1e-3, 3e-3):
        train(load_recipe(chat_recipe(model, scratch / f"run-{lr:g}", max_steps=4, learning_rate=lr)))
        runs.append(scratch / f"run-{lr:g}")
    return runs


def run_verb(tree: Path, verb: list[str]) -> float:
    """Seconds for ``hf-tune VERB`` with the package of ``tree``, run from it (``-m`` puts the working directory
    first on the path, before the editable install's)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_tune.commands.cli", *verb], cwd=tree, env=env, check=True,
                   capture_output=True)
    return time.perf_counter() - began


def heavy_imports(verb: list[str]) -> list[str]:
    code = ("import sys\nfrom hf_tune.commands.cli import main\nsys.argv = ['hf-tune', *sys.argv[1:]]\ntry:\n"
            "    main()\nexcept SystemExit:\n    pass\n"
            f"print('\\nLOADED', *sorted(m for m in sys.modules if m in {HEAVY!r}))")
    done = subprocess.run([sys.executable, "-c", code, *verb], capture_output=True, text=True, cwd=REPO)
    line = [text for text in done.stdout.splitlines() if text.startswith("LOADED")]
    return line[-1].split()[1:] if line else ["?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--imports", action="store_true")
    parser.add_argument("--against", help="a commit whose package runs each verb too, alternated")
    options = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    try:
        first, second = train_two_runs(scratch)
        verbs = {"--help": ["--help"], "validate": ["validate", "recipes/llm_lora.yaml"],
                 "report": ["report", str(first)],
                 "compare": ["compare", str(first), str(second), "--out", str(scratch / "compare")]}
        trees = {"this tree": REPO}
        if options.against:
            subprocess.run(["git", "worktree", "add", "--detach", str(scratch / "against"), options.against],
                           cwd=REPO, check=True, capture_output=True)
            trees[options.against] = scratch / "against"
        times = {(tree, name): [] for tree in trees for name in verbs}
        for _ in range(options.runs):
            for name, verb in verbs.items():
                for tree, root in trees.items():
                    times[tree, name].append(run_verb(root, verb))
        print(f"{'verb':<10} {'tree':<12} {'median s':>9} {'min s':>7}"
              + ("  heavy modules imported" if options.imports else ""))
        for (tree, name), seconds in times.items():
            extra = f"  {' '.join(heavy_imports(verbs[name])) or 'none'}" if options.imports and tree == "this tree" \
                else ""
            print(f"{name:<10} {tree:<12} {statistics.median(seconds):>9.2f} {min(seconds):>7.2f}{extra}")
    finally:
        if (scratch / "against").exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(scratch / "against")], cwd=REPO)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
