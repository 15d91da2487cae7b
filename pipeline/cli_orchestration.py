"""``ardit compile | submit | schedule | run-local``: the orchestration commands (registered by pipeline/cli.py).

kfp / hera are imported inside the commands so that ``ardit --help`` stays fast.
"""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.cluster import RUN_PARAMETERS, SWEEP_PARAMETERS
from pipeline.kfp_pipelines import (
    PIPELINES,  # a light module: kfp is imported inside its functions
)

app = typer.Typer(help="Compile, submit, schedule and run the batch pipelines.", no_args_is_help=True)


class Engine(str, Enum):
    kfp = "kfp"
    argo = "argo"
    all = "all"


class SubmitEngine(str, Enum):  # a run goes to one engine: no "all" here
    kfp = "kfp"
    argo = "argo"


def _settings(path: Path | None, images: Path | None = None, need_images: str = "") -> Any:
    """ClusterSettings from ``--settings``, image names resolved through ``--images``.

    ``need_images``: what runs its images as written (KFP, the Argo cron), for which bare kustomize
    names are a usage error."""
    from pipeline.cluster import ClusterSettings, read_kustomize_images, unresolved_images

    try:
        s = ClusterSettings.from_yaml(path) if path else ClusterSettings()
        if images:
            s = s.with_images(read_kustomize_images(images))
    except (ValueError, TypeError, KeyError) as e:
        raise typer.BadParameter(str(e), param_hint="--settings/--images") from e
    if need_images.startswith("KFP") and s.rdma_resource:
        raise typer.BadParameter(
            f"rdma_resource={s.rdma_resource!r}: KFP cannot give its task pods IPC_LOCK, which RDMA registration "
            "needs: use Argo for RDMA (docs/deploy.md section 11), or leave rdma_resource out for KFP",
            param_hint="--settings")
    if need_images and (bare := unresolved_images(s)):
        raise typer.BadParameter(
            f"{need_images} needs pullable images, got {', '.join(bare)}: pass --images "
            "manifests/images/kustomization.yaml (written by images/build.sh) or set gpu_image / tools_image in "
            "--settings", param_hint="--images")
    return s


SettingsOpt = Annotated[Path | None, typer.Option(
    "--settings", help="YAML with ClusterSettings overrides (pools, images, deadlines, cron)", exists=True,
    dir_okay=False)]
ImagesOpt = Annotated[Path | None, typer.Option(
    "--images", help="kustomize file whose `images:` name the image references (manifests/images/"
    "kustomization.yaml, written by images/build.sh); required for KFP", exists=True, dir_okay=False)]
ParamOpt = Annotated[list[str] | None, typer.Option(
    "-p", "--param", help=f"pipeline parameter KEY=VALUE (repeatable): {', '.join(RUN_PARAMETERS)}; "
    f"accuracy_sweep: {', '.join(SWEEP_PARAMETERS)}")]
TokenOpt = Annotated[str | None, typer.Option(envvar="ARDIT_SUBMIT_TOKEN", help="bearer token")]


@app.command("compile")
def compile_cmd(
    out: Annotated[Path, typer.Option("--output", "-o", "--out",
                                      help="output folder: writes OUT/kfp/<pipeline>.yaml, OUT/argo/<name>.yaml")],
    engine: Annotated[Engine, typer.Option(help="which engine's files to write")] = Engine.all,
    settings: SettingsOpt = None,
    images: ImagesOpt = None,
) -> None:
    """Write the KFP IR YAML of every pipeline and the Argo WorkflowTemplates + CronWorkflow.

    The cron and the KFP pipelines run their images as written, so they need --images (or images in
    --settings); without, only the Argo WorkflowTemplates are written, with the kustomize image
    names that `kubectl apply -k` pins (`--engine argo`, e.g. into manifests/base)."""
    from pipeline.cluster import unresolved_images

    if engine != Engine.argo:
        import kfp  # noqa: F401 - a missing extra is said first (pip install 'ardit[orchestration]')
    s = _settings(settings, images, need_images="" if engine == Engine.argo else
                  "KFP (and the Argo cron; --engine argo without --images writes only the WorkflowTemplates)")
    pinned = not unresolved_images(s)
    written: list[str] = []
    if engine in (Engine.kfp, Engine.all):
        from pipeline.kfp_pipelines import compile_pipelines

        written += compile_pipelines(str(out / "kfp"), s)
    if engine in (Engine.argo, Engine.all):
        from pipeline.argo import write_all

        written += [str(p) for p in write_all(out / "argo", s, cron=pinned)]
    if not pinned:
        typer.echo("note: no --images: wrote the WorkflowTemplates with the kustomize image names (kubectl apply -k "
                   "pins them), not the CronWorkflow, which runs its images as written: pass --images "
                   "manifests/images/kustomization.yaml for it", err=True)
    for path in written:
        typer.echo(path)


@app.command("pin-images")
def pin_images_cmd(
    images: Annotated[Path, typer.Option(
        "--images", help="kustomize file whose `images:` name the references (manifests/images/kustomization.yaml)",
        exists=True, dir_okay=False)],
) -> None:
    """Read one object (YAML or JSON) on stdin, write it with its ardit images replaced by --images.

    For the cron after an image rebuild: `kubectl get cronworkflow NAME -o yaml | ardit pin-images
    --images FILE | kubectl replace -f -` changes the images only; its suspend state and any patch stay."""
    import sys

    import yaml

    from pipeline.cluster import pin_images, read_kustomize_images

    refs = read_kustomize_images(images)
    if not refs:
        raise typer.BadParameter(f"{images} names no images", param_hint="--images")
    obj = yaml.safe_load(sys.stdin.read())
    if not isinstance(obj, dict):
        raise typer.BadParameter("stdin holds no Kubernetes object (expected YAML or JSON)", param_hint="stdin")
    if pin_images(obj, refs) == 0:
        raise typer.BadParameter(f"the object has no image named {' or '.join(sorted(refs))}", param_hint="stdin")
    typer.echo(yaml.safe_dump(obj, sort_keys=False), nl=False)


def parse_params(pairs: list[str]) -> dict[str, str]:
    params: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="-p/--param")
        params[key] = value
    return params


def check_params(pipeline: str, params: dict[str, str]) -> None:
    """Known names, required ones present, model and weights PVC consistent: before anything is sent."""
    from pipeline.cluster import RUN_PARAMETERS, SWEEP_PARAMETERS, check_model_and_weights

    known = SWEEP_PARAMETERS if pipeline == "accuracy_sweep" else RUN_PARAMETERS
    unknown = set(params) - set(known)
    if unknown:
        raise typer.BadParameter(f"unknown parameters {sorted(unknown)}; known: {sorted(known)}",
                                 param_hint="-p/--param")
    missing = {k for k, v in known.items() if v is None} - set(params)
    if missing:
        raise typer.BadParameter(f"missing required parameters: {sorted(missing)}", param_hint="-p/--param")
    merged = {k: v for k, v in known.items() if v is not None} | params
    try:
        check_model_and_weights(merged.get("model", ""), merged.get("weights_pvc", ""))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="-p/--param") from e


def _typed_kfp_arguments(pipeline_fn: Any, params: dict[str, str]) -> dict[str, Any]:
    """KFP checks argument types, so cast the CLI's strings to the pipeline's declared input types."""
    inputs = pipeline_fn.component_spec.inputs or {}
    unknown = set(params) - set(inputs)
    if unknown:
        raise typer.BadParameter(f"unknown parameters {sorted(unknown)}; known: {sorted(inputs)}",
                                 param_hint="-p/--param")
    cast = {"Integer": int, "Float": float, "Boolean": lambda v: v.lower() in ("1", "true", "yes")}
    try:
        return {k: cast.get(inputs[k].type, str)(v) for k, v in params.items()}
    except ValueError as e:
        raise typer.BadParameter(f"{e}", param_hint="-p/--param") from e


def _kfp_client(host: str, token: str | None, namespace: str | None) -> Any:
    import warnings

    import kfp

    with warnings.catch_warnings():  # kfp warns on every Client() that it needs a v2 backend
        warnings.simplefilter("ignore", FutureWarning)
        return kfp.Client(host=host, existing_token=token, namespace=namespace)


class _KfpErrors:
    """Turns the KFP client's connection and API errors into one-line exits."""

    def __init__(self, host: str):
        self.host = host

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, e: Any, tb: Any) -> bool:
        import urllib3
        from kfp_server_api.exceptions import ApiException

        if isinstance(e, urllib3.exceptions.HTTPError):
            raise SystemExit(f"error: cannot reach the KFP API at {self.host}: {getattr(e, 'reason', e)}") from e
        if isinstance(e, ApiException):
            raise SystemExit(f"error: the KFP API at {self.host} answered {e.status} {e.reason}: {e.body}") from e
        return False


def _compile_to(fn: Any, tmp: str, name: str) -> str:
    from kfp import compiler

    package = str(Path(tmp) / f"{name}.yaml")
    compiler.Compiler().compile(pipeline_func=fn, package_path=package)
    return package


def _submit_kfp(pipeline: str, params: dict[str, str], host: str, token: str | None, namespace: str | None,
                experiment: str, settings: Any) -> str:
    import tempfile

    from pipeline.kfp_pipelines import build_pipelines

    fn = build_pipelines(settings)[pipeline]
    arguments = _typed_kfp_arguments(fn, params)
    with tempfile.TemporaryDirectory() as tmp, _KfpErrors(host):
        package = _compile_to(fn, tmp, pipeline)
        client = _kfp_client(host, token, namespace)
        run_name = params.get("run_id") or params.get("sweep_id")
        run = client.create_run_from_pipeline_package(package, arguments=arguments, run_name=run_name,
                                                      experiment_name=experiment, namespace=namespace)
    return run.run_id


@app.command("submit")
def submit_cmd(
    engine: Annotated[SubmitEngine, typer.Option(help="kfp or argo")],
    host: Annotated[str, typer.Option(help="KFP API (e.g. http://ml-pipeline-ui.kubeflow) or Argo server "
                                           "(e.g. https://argo-server.argo:2746) URL")],
    pipeline: Annotated[str, typer.Option(help="batch_edit, generate_dataset or accuracy_sweep")] = "batch_edit",
    param: ParamOpt = None,
    token: TokenOpt = None,
    namespace: Annotated[str, typer.Option(help="namespace (KFP: multi-user profile namespace)")] = "ardit",
    experiment: Annotated[str, typer.Option(help="KFP experiment name")] = "ardit",
    insecure: Annotated[bool, typer.Option(help="Argo: do not verify the server's TLS certificate")] = False,
    settings: SettingsOpt = None,
    images: ImagesOpt = None,
) -> None:
    """Start a run on a cluster; prints the run id and the engine's run name."""
    if pipeline not in PIPELINES:
        raise typer.BadParameter(f"{pipeline!r} is not one of {PIPELINES}", param_hint="--pipeline")
    params = parse_params(param or [])
    if pipeline != "accuracy_sweep":
        # Each run gets its own id unless the caller resumes one by passing it again.
        params.setdefault("run_id", time.strftime("ardit-%Y%m%d-%H%M%S", time.gmtime()))
    check_params(pipeline, params)
    if engine == SubmitEngine.kfp:
        name = _submit_kfp(pipeline, params, host, token, namespace, experiment,
                           _settings(settings, images, need_images="KFP"))
    else:
        from pipeline.argo import SubmitError, submit

        try:
            name = submit(pipeline, params, host=host, namespace=namespace, token=token, verify_ssl=not insecure)
        except SubmitError as e:
            raise SystemExit(f"error: {e}") from e
    typer.echo(json.dumps({"engine": engine.value, "pipeline": pipeline,
                           "run_id": params.get("run_id") or params.get("sweep_id"), "name": name}))


def kfp_cron(expression: str) -> str:
    """KFP's scheduler reads cron with a leading seconds field: "0 2 * * *" -> "0 0 2 * * *"."""
    fields = expression.split()
    if len(fields) != 5:
        raise typer.BadParameter(f"cron_schedule {expression!r}: expected 5 fields (minute hour day month weekday)",
                                 param_hint="--settings")
    return "0 " + expression


def recurring_run_request(settings: Any, params: dict[str, str], *, experiment_id: str, package: str,
                          enabled: bool) -> dict[str, Any]:
    """Keyword arguments of ``kfp.Client.create_recurring_run`` equivalent to the Argo CronWorkflow."""
    from pipeline.argo import CRON_NAME

    return {
        "experiment_id": experiment_id,
        "job_name": CRON_NAME,
        "description": f"generate_dataset on {params['dataset']} every '{settings.cron_schedule}'",
        "cron_expression": kfp_cron(settings.cron_schedule),
        "max_concurrency": 1,  # concurrencyPolicy: Forbid
        "no_catchup": True,  # missed slots are skipped, as past startingDeadlineSeconds
        "params": params,
        "pipeline_package_path": package,
        "enabled": enabled,
        "enable_caching": False,
    }


@app.command("schedule")
def schedule_cmd(
    host: Annotated[str, typer.Option(help="KFP API URL (e.g. http://ml-pipeline-ui.kubeflow)")],
    param: ParamOpt = None,
    enable: Annotated[bool, typer.Option(
        help="start the schedule now (default: created disabled, like the Argo cron ships suspended)")] = False,
    replace: Annotated[bool, typer.Option(help="delete an existing recurring run of the same name first")] = False,
    token: TokenOpt = None,
    namespace: Annotated[str, typer.Option(help="KFP namespace (multi-user profile namespace)")] = "ardit",
    experiment: Annotated[str, typer.Option(help="KFP experiment name")] = "ardit",
    settings: SettingsOpt = None,
    images: ImagesOpt = None,
) -> None:
    """Create the KFP recurring run equivalent to the Argo CronWorkflow (cron_* settings, -p overrides)."""
    import tempfile

    from pipeline.argo import CRON_NAME
    from pipeline.kfp_pipelines import SCHEDULED_PIPELINE, build_pipelines

    s = _settings(settings, images, need_images="KFP")
    params = {k: v for k, v in s.cron_parameters().items() if v is not None} | parse_params(param or [])
    check_params("generate_dataset", params | {"run_id": "scheduled"})
    fn = build_pipelines(s)[SCHEDULED_PIPELINE]
    arguments = _typed_kfp_arguments(fn, params)
    with tempfile.TemporaryDirectory() as tmp, _KfpErrors(host):
        package = _compile_to(fn, tmp, SCHEDULED_PIPELINE)
        client = _kfp_client(host, token, namespace)
        exp = client.create_experiment(name=experiment, namespace=namespace)
        existing = [r for r in (client.list_recurring_runs(experiment_id=exp.experiment_id, page_size=100)
                                .recurring_runs or []) if r.display_name == CRON_NAME]
        if existing and not replace:
            raise SystemExit(f"error: recurring run {CRON_NAME} already exists in experiment {experiment} "
                             f"(id {existing[0].recurring_run_id}): pass --replace to recreate it")
        for r in existing:
            client.delete_recurring_run(r.recurring_run_id)
        run = client.create_recurring_run(**recurring_run_request(s, arguments, experiment_id=exp.experiment_id,
                                                                  package=package, enabled=enable))
    typer.echo(json.dumps({"engine": "kfp", "recurring_run_id": run.recurring_run_id, "name": CRON_NAME,
                           "cron": kfp_cron(s.cron_schedule), "enabled": enable}))


@app.command("run-local")
def run_local_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", help="output folder")] = Path("ardit-local"),
    dataset: Annotated[str | None, typer.Option(
        help="edit dataset; default: a small sample written into the output folder")] = None,
    run_id: Annotated[str | None, typer.Option(help="default: local-<UTC time>; pass again to resume")] = None,
    num_shards: Annotated[int, typer.Option(help="shards to split the dataset into")] = 2,
    model: Annotated[str, typer.Option(help="tiny | hunyuan-image-3 | a checkpoint directory")] = "tiny",
    weights: Annotated[str | None, typer.Option(help="safetensors directory (default: seeded random)")] = None,
    kv_store: Annotated[str | None, typer.Option(help="default: local://OUTPUT/_kv")] = None,
    steps: Annotated[int | None, typer.Option(help="denoising steps (default: the model's generation config)")]
    = None,
    guidance: Annotated[float | None, typer.Option(help="CFG scale (default: the model's generation config)")]
    = None,
) -> None:
    """Run the batch_edit pipeline on this machine through kfp.local (no cluster, no Docker)."""
    from pipeline.kfp_local import run_local

    result = run_local(str(output), dataset=dataset, run_id=run_id, num_shards=num_shards, model=model,
                       kv_store=kv_store, weights=weights, steps=steps, guidance=guidance)
    s = result["summary"]
    typer.echo(json.dumps({"run_id": result["run_id"], "output": result["output"],
                           "rows_total": s.get("rows_total"), "rows_ok": s.get("rows_ok"),
                           "rows_failed": s.get("rows_failed"), "complete": s.get("complete")}))
