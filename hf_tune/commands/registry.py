"""``hf-tune register RUN_DIR --name NAME`` (a run's model as a new version in the MLflow registry) and ``hf-tune
promote NAME VERSION --alias A`` (an alias pointed at a version): ``workflows/registry.py``."""

from __future__ import annotations

from hf_tune.commands.verb import RUN_DIR, TRACKING_URI, Verb, option


def register(args) -> None:
    from hf_tune.workflows.registry import register as register_run

    result = register_run(args.run_dir, args.name, alias=args.alias, tracking_uri=args.tracking_uri)
    print(f"registered {result['model_uri']} (MLflow run {result['run_id']} at {result['tracking_uri']})"
          + (f"; alias {result['alias']} -> version {result['version']}" if result["alias"] else ""))


def promote(args) -> None:
    from hf_tune.workflows.registry import promote as promote_version

    result = promote_version(args.name, args.version, args.alias, tracking_uri=args.tracking_uri)
    print(f"{result['name']}@{result['alias']} -> version {result['version']}"
          + (f" (was version {result['previous']})" if result["previous"] else ""))


REGISTER = Verb(register, "log a run's model to the MLflow registry as a new version of NAME", options=(
    RUN_DIR, option("--name", required=True, help="the registered model's name"),
    option("--alias", default=None, help="point this alias (e.g. staging) at the new version"),
    option("--tracking-uri", default=None, help=f"{TRACKING_URI}, else the run folder's store")))
PROMOTE = Verb(promote, "point an alias of a registered model (e.g. production) at a version", options=(
    option("name"), option("version"), option("--alias", required=True),
    option("--tracking-uri", default=None, help=TRACKING_URI)))
