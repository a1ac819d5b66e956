"""``hf-tune push RUN_DIR --repo-id OWNER/NAME``: a run (its adapter, or the merged model) uploaded to the Hub with a
model card (``workflows/hub.py``); no secret and, unless asked, no manifest or tracker log goes with it."""

from __future__ import annotations

from hf_tune.catalog.trackers import tracker_files
from hf_tune.commands.verb import RUN_DIR, Verb, option


def run(args) -> None:
    from hf_tune.workflows.hub import push

    url = push(args.run_dir, args.repo_id, merged=args.merged, private=args.private, revision=args.revision,
               base_model=args.base_model, include_manifest=args.include_manifest, include_logs=args.include_logs)
    print(f"pushed: {url}")


VERB = Verb(run, "upload a run (adapter, or --merged model) with a model card to the Hub", options=(
    RUN_DIR, option("--repo-id", required=True, help="OWNER/NAME"),
    option("--merged", action="store_true", help="push the merged model instead of the adapter"),
    option("--private", action="store_true"),
    option("--revision", default=None, help="a branch (created if needed)"),
    option("--base-model", default=None, metavar="ORG/NAME",
           help="the base model's Hub id, for an adapter trained on a local folder"),
    option("--include-manifest", action="store_true",
           help="also upload run.json (host name, command line, environment), trainer_state.json and plots"),
    option("--include-logs", action="store_true",
           help=f"also upload tracker logs ({', '.join(f'{folder}/' for folder in tracker_files('logs'))})")))
