"""``hf-tune``: one sub-command per verb, each verb a module of this folder with its options, its call and its
printout (``VERB``); this module only lists them. A verb imports the libraries it calls when it runs, so ``hf-tune
--help`` (and a mistyped verb) loads no library."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from hf_tune.commands import (
    chat,
    compare,
    cv,
    data_preview,
    evaluate,
    export,
    generate,
    init_recipe,
    merge,
    plan,
    profile,
    push,
    registry,
    report,
    reproduce,
    search,
    serve,
    train,
    validate,
)
from hf_tune.commands.command_line import DEBUG_HELP, plain_progress_off_a_terminal, recipe_arguments, user_errors
from hf_tune.runtime.output_paths import check_output
from hf_tune.runtime.process import settle_process


def installed_version() -> str:
    """The installed distribution's version (what pip sees), else the source tree's ``hf_tune.__version__``."""
    try:
        return version("hf_tune")
    except PackageNotFoundError:
        return sys.modules["hf_tune"].__version__  # the package this module is in: loaded, not imported up


VERBS = {  # in the order `hf-tune --help` lists them
    "train": train.VERB, "validate": validate.VERB, "plan": plan.VERB, "data": data_preview.VERB,
    "profile": profile.VERB, "cv": cv.VERB, "search": search.VERB, "init": init_recipe.VERB, "report": report.VERB,
    "eval": evaluate.VERB, "merge": merge.VERB, "export": export.VERB, "reproduce": reproduce.VERB,
    "generate": generate.VERB, "serve": serve.VERB, "push": push.VERB, "compare": compare.VERB,
    "register": registry.REGISTER, "promote": registry.PROMOTE, "chat": chat.VERB,
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
