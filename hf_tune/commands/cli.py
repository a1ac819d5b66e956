"""``hf-tune`` verbs. Each one parses its arguments and calls the notebook API; no logic lives here. A verb imports
what it calls when it runs, so ``hf-tune --help`` (and a mistyped verb) loads no library."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from hf_tune.catalog.export_formats import DEFAULT_EXPORT_FORMAT, DEFAULT_GGUF_QUANT, EXPORT_FORMATS, GGUF_QUANTS
from hf_tune.catalog.trackers import tracker_files
from hf_tune.commands import publish
from hf_tune.commands.command_line import DEBUG_HELP, plain_progress_off_a_terminal, recipe_arguments, user_errors
from hf_tune.commands.option_types import device_here, gpu_memory_gb, number, whole
from hf_tune.commands.verb import Verb, answers_of_this_input, option, written_by_init
from hf_tune.runtime.output_paths import Output, check_output, starts_with
from hf_tune.runtime.process import settle_process


def _validate(args) -> None:
    from hf_tune.commands.effective import validate_command

    validate_command(args)


def _chat(args) -> None:
    from hf_tune.commands.chat import chat_command  # loads torch: only when the verb runs

    chat_command(args)


def _train(args) -> None:
    from hf_tune.commands.train import main as train_main

    train_main([args.recipe, *args.overrides] + (["--debug"] if args.debug else []))


def _plan(args) -> None:
    from hf_tune.assembly.loading import load_recipe
    from hf_tune.commands.plan_text import format_plan
    from hf_tune.workflows.plan import plan

    print(format_plan(plan(load_recipe(args.recipe, args.overrides), world_size=args.world_size, out_dir=args.out)))


def _init(args) -> None:
    from hf_tune.commands.init_recipe import write_recipe

    out = args.out or f"{args.model.rsplit('/', 1)[-1].lower()}-{args.gpus}x{args.gpu_memory:g}gb.yaml"
    choice = write_recipe(args.model, out, gpus=args.gpus, gpu_memory_gb=args.gpu_memory, tuning=args.tuning,
                          setup=args.setup, max_length=args.max_length, data=args.data)
    print(f"wrote {out}: {choice.tuning}, {choice.setup}, activation checkpointing "
          f"{'on' if choice.checkpointing else 'off'}, packs of {choice.tokens:,} tokens x {choice.accumulation} "
          f"accumulated; estimated peak {choice.peak / 2**30:.1f} GB per GPU of {args.gpu_memory:g} GB")
    if args.data is None:
        print("data.train.path is the placeholder data/train.jsonl: put your chat JSONL there, or edit the recipe")


def _data(args) -> None:
    from hf_tune.assembly.loading import load_recipe
    from hf_tune.commands.data_preview import data_preview

    colour = sys.stdout.isatty() and not args.no_colour
    print(data_preview(load_recipe(args.recipe, args.overrides), count=args.n, colour=colour))


def _cv(args) -> None:
    from hf_tune.assembly.loading import load_recipe
    from hf_tune.search.folds import cross_validate

    result = cross_validate(load_recipe(args.recipe, args.overrides), args.folds)
    for name, stats in result["summary"].items():
        print(f"{name}: {stats['mean']:.4f} ± {stats['std']:.4f}")


def _search(args) -> None:
    from hf_tune.assembly.loading import load_recipe
    from hf_tune.search import format_summary, search

    recipe = load_recipe(args.recipe, args.overrides)
    if args.dashboard:
        from hf_tune.search.dashboard import dashboard_instructions

        print(dashboard_instructions(recipe), flush=True)
    print(format_summary(search(recipe)))


def _report(args) -> None:
    from hf_tune.records.report import write_report

    for path in write_report(args.run_dir):
        print(path)


def _eval(args) -> None:
    from hf_tune.commands.evaluate import eval_command

    eval_command(args)


def _generate(args) -> None:
    from hf_tune.commands.generate import generate_file

    result = generate_file(args.run_dir, args.input, args.out, batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, device=args.device, dtype=args.dtype)
    print(f"{result['out']}: {result['answers']} answers"
          + (f" (the first {result['resumed_after']} kept from an interrupted run)" if result["resumed_after"] else ""))


def _reproduce(args) -> None:
    from hf_tune.commands.reproduce import reproduce

    second, comparison = reproduce(args.run_dir, out=args.out, against=args.against)
    print(comparison.report(Path(args.run_dir), second))
    if not comparison.reproduced:
        raise SystemExit(1)


def _serve(args) -> None:
    from hf_tune.commands.serve import serve

    serve(args.run_dir, host=args.host, port=args.port, device=args.device, dtype=args.dtype)


def _profile(args) -> None:
    from hf_tune.assembly.loading import load_recipe
    from hf_tune.commands.profile import profile_recipe
    from hf_tune.trainer.profiling import format_profile

    summary = profile_recipe(load_recipe(args.recipe, args.overrides), out=args.out)
    print(format_profile(summary, Path(summary["dir"])))


def _compare(args) -> None:
    from hf_tune.search.compare import collect_runs, comparison_table, format_table, plot_comparison

    runs = collect_runs(args.run_dirs)
    print(format_table(comparison_table(runs)))
    print(f"curves: {plot_comparison(runs, args.out)}")


def installed_version() -> str:
    """The installed distribution's version (what pip sees), else the source tree's ``hf_tune.__version__``."""
    try:
        return version("hf_tune")
    except PackageNotFoundError:
        return sys.modules["hf_tune"].__version__  # the package this module is in: loaded, not imported up


RUN_DIR = option("run_dir")
DEVICE = option("--device", type=device_here, default=None, help="default: cuda if available, else mps, else cpu")
DTYPE = option("--dtype", default=None, choices=("auto", "bfloat16", "float16", "float32"),
               help="default: bfloat16 on a GPU that supports it, else float32; auto: the checkpoint's dtype")
GENERATION = (  # chat's and generate's
    option("--max-new-tokens", type=whole(1), default=128),
    option("--temperature", type=number(0), default=0.0, help="0 (default): greedy; above 0: sampled"),
    option("--top-p", type=number(0, 1, low_open=True), default=1.0,
           help="nucleus sampling (with --temperature above 0)"),
    option("--seed", type=whole(0), default=None, help="makes sampled replies repeatable"))
TRACKING_URI = "default: MLFLOW_TRACKING_URI"
VERBS = {  # in the order `hf-tune --help` lists them
    "train": Verb(_train, "train from a recipe (same as python -m hf_tune.run)", True),
    "validate": Verb(_validate, "check a recipe and print it fully resolved", True),
    "plan": Verb(_plan, "batch sizes, steps, optimizer groups and lr_schedule.png, without training", True, (
        option("--world-size", type=whole(1), default=None, help="plan for N processes (default: this launch's)"),
        option("--out", default=None, help="folder for lr_schedule.png (default: training.output_dir)")),
        output=Output("folder")),
    "data": Verb(_data, "the first training examples as the model reads them, trained tokens marked; tokens per "
                 "example and per step, examples per pack, the share the loss ignores", True, (
        option("--n", type=whole(1), default=3, help="examples to show (default 3)"),
        option("--no-colour", action="store_true", help="mark trained tokens with [[ ]] in a terminal too"))),
    "profile": Verb(_profile, "a short run of the profile section's steps under torch.profiler: trace, top operators, "
                    "step-time shares", True, (
        option("--out", default=None, help="folder of the profiled run (default: training.output_dir + -profile; the "
               "real run folder is not touched)"),), output=Output("folder")),
    "cv": Verb(_cv, "stratified k-fold cross-validation of a classification recipe", True,
               (option("--folds", type=whole(2), default=5),)),
    "search": Verb(_search, "hyperparameter search from the recipe's search section (Optuna or Ray Tune)", True, (
        option("--dashboard", action="store_true", help="first print how to open optuna-dashboard on the study's "
               "storage (pip install 'hf_tune[dashboard]')"),)),
    "init": Verb(_init, "write a recipe for MODEL whose plan fits the machine (each choice commented)", options=(
        option("model", help="a Hub id, local folder or embedded: name (its config is read, no weight)"),
        option("--gpus", type=whole(1, 4096), default=1, help="GPUs the run uses (default 1)"),
        option("--gpu-memory", type=gpu_memory_gb, default=80, help="GB of memory per GPU (default 80)"),
        option("--tuning", default="auto", choices=["auto", "full", "lora", "qlora"],
               help="default: the fastest that fits (full for models under 2B parameters, then LoRA, then QLoRA)"),
        option("--setup", default="auto", choices=["auto", "ddp", "zero2", "zero3"],
               help="distribution (default: the fastest that fits: DDP, then ZeRO-2, then ZeRO-3)"),
        option("--max-length", type=whole(1), default=4096, help="longest example in tokens (data.max_length)"),
        option("--data", default=None, help="chat data (JSONL of messages) for data.train.path (default: the "
               "placeholder data/train.jsonl, which the recipe says to fill)"),
        option("--out", default=None, help="the recipe file (default: NAME-NxGBgb.yaml; a file init did not write "
               "is never overwritten)")), output=Output("file", ours=written_by_init, inputs=("data",))),
    "report": Verb(_report, "plot a run's loss, learning rates and eval metrics into PNG files", options=(RUN_DIR,)),
    "eval": Verb(_eval, "lm-eval scores of a run, one checkpoint, or (--watch) each new complete checkpoint of a run "
                 "in progress, into RUN_DIR/eval_scores.jsonl", options=(
        option("run_dir", help="a run folder (its recipe's evaluation.tasks), or a model folder with --tasks"),
        option("--checkpoint", type=whole(0), default=None, metavar="N",
               help="score checkpoint-N (complete ones only)"),
        option("--watch", action="store_true", help="score each complete checkpoint as it appears, until the run ends"),
        option("--interval", type=number(0, low_open=True), default=10.0,
               help="seconds between looks for new checkpoints (--watch)"),
        option("--wait", type=number(0), default=600.0, help="seconds to wait for RUN_DIR to appear (--watch started "
               "before the run); a path whose parent does not exist is refused at once"),
        option("--tasks", default=None, help="comma-separated lm-eval tasks or task YAMLs (default: the recipe's)"),
        option("--limit", type=number(0, low_open=True), default=None, help="examples per task (a fraction if < 1)"),
        option("--num-fewshot", type=whole(0), default=None), option("--batch-size", type=whole(1), default=None),
        option("--apply-chat-template", action="store_true", default=None,
               help="ask each prompt as a user turn through the chat template (lm-eval's apply_chat_template)"),
        option("--device", type=device_here, default=None), option("--dtype", default=None))),
    "merge": Verb(publish.merge, "merge a LoRA run's adapter into its base model", options=(
        RUN_DIR, option("--out", default=None, help="default: RUN_DIR/merged"),
        option("--dtype", default="float32", help="float32 | bfloat16 | float16 (a QLoRA run's 4-bit base is "
               "dequantized to it); the merge streams the base's safetensors shard by shard"),
        option("--check", action="store_true", help="compare merged logits with base + adapter (one model in memory "
               "at a time)")), output=Output("folder", inputs=("run_dir",))),
    "export": Verb(publish.export, "write a run as one GGUF file (llama.cpp, LM Studio) or GGUF + Modelfile "
                   "(Ollama); a LoRA run is merged by shard first", options=(
        RUN_DIR, option("--format", default=DEFAULT_EXPORT_FORMAT, choices=list(EXPORT_FORMATS), help="; ".join(
            f"{fmt.name}: {fmt.summary}" for fmt in EXPORT_FORMATS.values())),
        option("--quant", default=DEFAULT_GGUF_QUANT, choices=list(GGUF_QUANTS), help="the 2-D weights' type (norms "
               f"and biases stay float32; default {DEFAULT_GGUF_QUANT})"),
        option("--out", default=None, help="the .gguf file (default: RUN_DIR/gguf/model-QUANT.gguf; the Modelfile "
               "goes beside it)")), output=Output("file", ours=starts_with(b"GGUF"), inputs=("run_dir",))),
    "reproduce": Verb(_reproduce, "train a finished run again from its folder alone and say whether its weights and "
                      "metrics match, naming what differs (exit 1 when they do not)", options=(
        RUN_DIR, option("--out", default=None, help="the rerun's folder (default: RUN_DIR-reproduced)"),
        option("--against", default=None, metavar="RUN_DIR2", help="compare with this finished run instead of "
               "training one (a rerun launched on several processes)")),
                      output=Output("folder", inputs=("run_dir", "against"))),
    "generate": Verb(_generate, "answer a JSONL file of prompts in batches (greedy by default: chat's answers)",
                     options=(
        RUN_DIR, option("--input", required=True, help="JSONL: {\"prompt\": ...} or {\"messages\": [...]} per line"),
        option("--out", required=True, help="JSONL: each input line plus \"answer\" (a rerun continues an "
               "interrupted one of the same input; a file of other answers is never overwritten)"),
        option("--batch-size", type=whole(1), default=8), *GENERATION, DEVICE, DTYPE),
        output=Output("file", ours=answers_of_this_input, inputs=("input", "run_dir"))),
    "serve": Verb(_serve, "an OpenAI-compatible server of a run (vLLM with the adapter where installed on a GPU, "
                  "else transformers serve on the merged model)", options=(
        RUN_DIR, option("--host", default="127.0.0.1"), option("--port", type=whole(1, 65535), default=8000),
        DEVICE, DTYPE)),
    "push": Verb(publish.push, "upload a run (adapter, or --merged model) with a model card to the Hub", options=(
        RUN_DIR, option("--repo-id", required=True, help="OWNER/NAME"),
        option("--merged", action="store_true", help="push the merged model instead of the adapter"),
        option("--private", action="store_true"),
        option("--revision", default=None, help="a branch (created if needed)"),
        option("--base-model", default=None, metavar="ORG/NAME",
               help="the base model's Hub id, for an adapter trained on a local folder"),
        option("--include-manifest", action="store_true",
               help="also upload run.json (host name, command line, environment), trainer_state.json and plots"),
        option("--include-logs", action="store_true", help="also upload tracker logs "
               f"({', '.join(f'{folder}/' for folder in tracker_files('logs'))})"))),
    "compare": Verb(_compare, "table of runs' differing recipe keys and results; their curves in one PNG", options=(
        option("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, or a search's study folder (its trials)"),
        option("--out", default="compare.png", help="the PNG of overlaid loss and eval curves")),
        output=Output("file", ours=starts_with(b"\x89PNG"))),
    "register": Verb(publish.register, "log a run's model to the MLflow registry as a new version of NAME", options=(
        RUN_DIR, option("--name", required=True, help="the registered model's name"),
        option("--alias", default=None, help="point this alias (e.g. staging) at the new version"),
        option("--tracking-uri", default=None, help=f"{TRACKING_URI}, else the run folder's store"))),
    "promote": Verb(publish.promote, "point an alias of a registered model (e.g. production) at a version", options=(
        option("name"), option("version"), option("--alias", required=True),
        option("--tracking-uri", default=None, help=TRACKING_URI))),
    "chat": Verb(_chat, "talk to a trained run (adapter or full model)", options=(
        RUN_DIR, option("--prompt", help="one message, answered once (default: interactive)"),
        option("--system", help="a system message"),
        *GENERATION, DEVICE, DTYPE)),
}


def parser() -> argparse.ArgumentParser:
    """``hf-tune``'s arguments: one sub-command per entry of ``VERBS``."""
    p = argparse.ArgumentParser(prog="hf-tune", description="Fine-tune Hugging Face models from a YAML recipe.")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    p.add_argument("--version", action="version", version=f"hf-tune {installed_version()}")
    verbs = p.add_subparsers(dest="verb", required=True)
    for name, verb in VERBS.items():
        v = verbs.add_parser(name, help=verb.help, parents=[recipe_arguments()] if verb.reads_recipe else [])
        for flags, settings in verb.options:
            v.add_argument(*flags, **settings)
        # `hf-tune validate R --debug` as well as `hf-tune --debug validate R`
        v.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        v.set_defaults(func=verb.run, output=verb.output)
    return p


def main(argv: list[str] | None = None) -> None:
    plain_progress_off_a_terminal()  # the verbs load their libraries inside, after this
    settle_process()
    args = parser().parse_args(argv)
    with user_errors(args.debug):
        if args.output is not None and getattr(args, "out", None) is not None:  # before any work, for every verb
            check_output(args.out, args.output, [getattr(args, name, None) for name in args.output.inputs], args)
        args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
