"""``ardit compile | submit | run-local``: the orchestration commands (registered by pipeline/cli.py).

kfp / hera are imported inside the commands so that ``ardit --help`` stays fast.
"""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.kfp_pipelines import (
    PIPELINES,  # a light module: kfp is imported inside its functions
)

app = typer.Typer(help="Compile, submit and run the batch pipelines.", no_args_is_help=True)


# Parameters without a default, per pipeline (run_id is generated when absent).
REQUIRED = {"batch_edit": {"dataset", "output"}, "generate_dataset": {"dataset", "output"},
            "accuracy_sweep": {"sweep_id"}}


class Engine(str, Enum):
    kfp = "kfp"
    argo = "argo"
    all = "all"


def _settings(path: Path | None) -> Any:
    from pipeline.cluster import ClusterSettings

    return ClusterSettings.from_yaml(path) if path else ClusterSettings()


SettingsOpt = Annotated[Path | None, typer.Option(
    "--settings", help="YAML with ClusterSettings overrides (pools, images, secrets)", exists=True, dir_okay=False)]


@app.command("compile")
def compile_cmd(
    out: Annotated[Path, typer.Option(help="output folder: writes OUT/kfp/<pipeline>.yaml, OUT/argo/<name>.yaml")],
    engine: Annotated[Engine, typer.Option(help="which engine's files to write")] = Engine.all,
    settings: SettingsOpt = None,
) -> None:
    """Write the KFP IR YAML of every pipeline and the Argo WorkflowTemplates + CronWorkflow."""
    s = _settings(settings)
    written: list[str] = []
    if engine in (Engine.kfp, Engine.all):
        from pipeline.kfp_pipelines import compile_pipelines

        written += compile_pipelines(str(out / "kfp"), s)
    if engine in (Engine.argo, Engine.all):
        from pipeline.argo import write_all

        written += [str(p) for p in write_all(out / "argo", s)]
    for path in written:
        typer.echo(path)


def parse_params(pairs: list[str]) -> dict[str, str]:
    params: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="-p/--param")
        params[key] = value
    return params


def _typed_kfp_arguments(pipeline_fn: Any, params: dict[str, str]) -> dict[str, Any]:
    """KFP checks argument types, so cast the CLI's strings to the pipeline's declared input types."""
    inputs = pipeline_fn.component_spec.inputs or {}
    unknown = set(params) - set(inputs)
    if unknown:
        raise typer.BadParameter(f"unknown parameters {sorted(unknown)}; known: {sorted(inputs)}",
                                 param_hint="-p/--param")
    cast = {"Integer": int, "Float": float, "Boolean": lambda v: v.lower() in ("1", "true", "yes")}
    return {k: cast.get(inputs[k].type, str)(v) for k, v in params.items()}


def _submit_kfp(pipeline: str, params: dict[str, str], host: str, token: str | None, namespace: str | None,
                experiment: str, settings: Any) -> str:
    import tempfile
    import warnings

    import kfp
    import urllib3
    from kfp import compiler
    from kfp_server_api.exceptions import ApiException

    from pipeline.kfp_pipelines import build_pipelines

    fn = build_pipelines(settings)[pipeline]
    arguments = _typed_kfp_arguments(fn, params)
    with tempfile.TemporaryDirectory() as tmp:
        package = str(Path(tmp) / f"{pipeline}.yaml")
        compiler.Compiler().compile(pipeline_func=fn, package_path=package)
        try:
            with warnings.catch_warnings():  # kfp warns on every Client() that it needs a v2 backend
                warnings.simplefilter("ignore", FutureWarning)
                client = kfp.Client(host=host, existing_token=token, namespace=namespace)
            run_name = params.get("run_id") or params.get("sweep_id")
            run = client.create_run_from_pipeline_package(package, arguments=arguments, run_name=run_name,
                                                          experiment_name=experiment, namespace=namespace)
        except urllib3.exceptions.HTTPError as e:
            raise SystemExit(f"error: cannot reach the KFP API at {host}: {getattr(e, 'reason', e)}") from e
        except ApiException as e:
            raise SystemExit(f"error: the KFP API at {host} answered {e.status} {e.reason}: {e.body}") from e
    return run.run_id


@app.command("submit")
def submit_cmd(
    engine: Annotated[Engine, typer.Option(help="kfp or argo")],
    host: Annotated[str, typer.Option(help="KFP API (e.g. http://ml-pipeline-ui.kubeflow) or Argo server "
                                           "(e.g. https://argo-server.argo:2746) URL")],
    pipeline: Annotated[str, typer.Option(help="batch_edit, generate_dataset or accuracy_sweep")] = "batch_edit",
    param: Annotated[list[str] | None, typer.Option(
        "-p", "--param", help="pipeline parameter KEY=VALUE (repeatable): dataset, output, run_id, num_shards, "
        "model, kv_store, steps, guidance, gpu_image, tools_image; accuracy_sweep: sweep_id, spec_config_map, "
        "gpu_image")] = None,
    token: Annotated[str | None, typer.Option(envvar="ARDIT_SUBMIT_TOKEN", help="bearer token")] = None,
    namespace: Annotated[str, typer.Option(help="namespace (KFP: multi-user profile namespace)")] = "ardit",
    experiment: Annotated[str, typer.Option(help="KFP experiment name")] = "ardit",
    insecure: Annotated[bool, typer.Option(help="Argo: do not verify the server's TLS certificate")] = False,
    settings: SettingsOpt = None,
) -> None:
    """Start a run on a cluster; prints the run id and the engine's run name."""
    if pipeline not in PIPELINES:
        raise typer.BadParameter(f"{pipeline!r} is not one of {PIPELINES}", param_hint="--pipeline")
    params = parse_params(param or [])
    if pipeline != "accuracy_sweep":
        # Each run gets its own id unless the caller resumes one by passing it again.
        params.setdefault("run_id", time.strftime("ardit-%Y%m%d-%H%M%S", time.gmtime()))
    missing = REQUIRED[pipeline] - set(params)
    if missing:
        raise typer.BadParameter(f"missing required parameters: {sorted(missing)}", param_hint="-p/--param")
    if engine == Engine.kfp:
        name = _submit_kfp(pipeline, params, host, token, namespace, experiment, _settings(settings))
    elif engine == Engine.argo:
        from pipeline.argo import SubmitError, submit

        try:
            name = submit(pipeline, params, host=host, namespace=namespace, token=token, verify_ssl=not insecure)
        except SubmitError as e:
            raise SystemExit(f"error: {e}") from e
    else:
        raise typer.BadParameter("choose kfp or argo", param_hint="--engine")
    typer.echo(json.dumps({"engine": engine.value, "pipeline": pipeline,
                           "run_id": params.get("run_id") or params.get("sweep_id"), "name": name}))


@app.command("run-local")
def run_local_cmd(
    output: Annotated[Path, typer.Option(help="output folder")] = Path("ardit-local"),
    dataset: Annotated[str | None, typer.Option(
        help="edit dataset; default: a small sample written into the output folder")] = None,
    run_id: Annotated[str | None, typer.Option(help="default: local-<UTC time>; pass again to resume")] = None,
    num_shards: int = 2,
    model: str = "tiny",
    weights: str | None = None,
    kv_store: Annotated[str | None, typer.Option(help="default: local://OUTPUT/_kv")] = None,
    steps: int = 4,
    guidance: float = 5.0,
) -> None:
    """Run the batch_edit pipeline on this machine through kfp.local (no cluster, no Docker)."""
    from pipeline.kfp_local import run_local

    result = run_local(str(output), dataset=dataset, run_id=run_id, num_shards=num_shards, model=model,
                       kv_store=kv_store, weights=weights, steps=steps, guidance=guidance)
    s = result["summary"]
    typer.echo(json.dumps({"run_id": result["run_id"], "output": result["output"],
                           "rows_total": s.get("rows_total"), "rows_ok": s.get("rows_ok"),
                           "rows_failed": s.get("rows_failed"), "complete": s.get("complete")}))
