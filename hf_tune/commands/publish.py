"""The verbs that publish a finished run (``hf-tune merge``, ``export``, ``push``, ``register``, ``promote``): each
calls the library and prints what it wrote."""

from __future__ import annotations


def merge(args) -> None:
    from hf_tune.workflows.merge_run import merge

    result = merge(args.run_dir, out=args.out, dtype=args.dtype, check=args.check)
    print(f"merged model: {result['merged_dir']} ({result['dtype']})")
    if args.check:
        print(f"check: max |Δ logit| = {result['max_abs_logit_diff']:.3g} ({result['relative_diff']:.2e} of the "
              f"largest logit; tolerance {result['tolerance']:g}): ok")


def export(args) -> None:
    from hf_tune.workflows.export import export

    result = export(args.run_dir, format=args.format, quant=args.quant, out=args.out)
    print(f"{result['gguf']}: {result['architecture']}, {result['quant']}, {result['tensors']} tensors, "
          f"{result['bytes'] / 2**20:,.1f} MiB")
    if "modelfile" in result:
        print(f"{result['modelfile']}: ollama create NAME -f {result['modelfile']}")


def push(args) -> None:
    from hf_tune.workflows.hub import push

    url = push(args.run_dir, args.repo_id, merged=args.merged, private=args.private, revision=args.revision,
               base_model=args.base_model, include_manifest=args.include_manifest, include_logs=args.include_logs)
    print(f"pushed: {url}")


def register(args) -> None:
    from hf_tune.workflows.registry import register

    result = register(args.run_dir, args.name, alias=args.alias, tracking_uri=args.tracking_uri)
    print(f"registered {result['model_uri']} (MLflow run {result['run_id']} at {result['tracking_uri']})"
          + (f"; alias {result['alias']} -> version {result['version']}" if result["alias"] else ""))


def promote(args) -> None:
    from hf_tune.workflows.registry import promote

    result = promote(args.name, args.version, args.alias, tracking_uri=args.tracking_uri)
    print(f"{result['name']}@{result['alias']} -> version {result['version']}"
          + (f" (was version {result['previous']})" if result["previous"] else ""))
