"""Argo Workflows definitions built with Hera: WorkflowTemplates for batch edit, dataset
generation and accuracy sweeps, and a CronWorkflow for scheduled generation.

DAG: shard -> fan-out over shard indices (withSequence, bounded by ``parallelism``) of a per-shard
DAG (AR -> DiT) -> summary. Shards are independent, so the AR of one shard overlaps the DiT of
another. Step templates take every per-run value as an input; only the top DAG binds them, which
lets the CronWorkflow bind ``run_id`` to its scheduled time. hera is imported inside functions.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.cluster import (
    DEFAULT_NO_RETRY_EXIT_CODES,
    KV_STORE_FROM_CONFIGMAP,
    NO_RETRY_EXIT_CODES,
    POD_IP_ENV,
    S3_SECRET_KEYS,
    SWEEP_OUTPUT,
    SWEEP_SPEC,
    ClusterSettings,
    Pool,
    step_args,
    step_command,
)

TEMPLATES = {"batch_edit": "ardit-batch-edit", "generate_dataset": "ardit-generate-dataset",
             "accuracy_sweep": "ardit-accuracy-sweep"}
CRON_NAME = "ardit-generate-dataset-cron"
# Same slot -> same run id, so a re-run (or `argo retry`) of a scheduled slot resumes its run
# instead of starting a new one. workflow.scheduledTime is RFC 3339 (2026-11-22T02:00:00Z); run ids
# become paths and allow only [A-Za-z0-9._-], so the expression keeps letters and digits:
# scheduled-20261122T020000Z.
CRON_RUN_ID_KEEP = "[^0-9A-Za-z]"
CRON_RUN_ID = "scheduled-{{=sprig.regexReplaceAll('" + CRON_RUN_ID_KEEP + "', workflow.scheduledTime, '')}}"


def retry_when(step: str) -> str:
    """Retry pod errors (eviction, node loss) and failures, except the exit codes no retry can fix."""
    codes = ", ".join(map(str, NO_RETRY_EXIT_CODES.get(step, DEFAULT_NO_RETRY_EXIT_CODES)))
    return f"lastRetry.status == 'Error' or (lastRetry.status == 'Failed' and asInt(lastRetry.exitCode) not in [{codes}])"


_STEP_INPUTS = {
    "shard": ("dataset", "output", "run_id", "num_shards", "kind", "model"),
    "ar": ("output", "run_id", "shard", "model", "kv_store"),
    "dit": ("output", "run_id", "shard", "model", "kv_store", "steps", "guidance"),
    "summary": ("output", "run_id"),
    "sweep": ("sweep_id",),
}
# Values fixed by the cluster layout rather than passed per run.
_STEP_FIXED = {"sweep": {"spec": SWEEP_SPEC, "output": SWEEP_OUTPUT}}
_RUN_VALUES = ("output", "run_id", "model", "kv_store", "steps", "guidance")


def _inputs(name: str) -> str:
    return "{{inputs.parameters." + name + "}}"


def _workflow(name: str) -> str:
    return "{{workflow.parameters." + name + "}}"


def workflow_parameters(settings: ClusterSettings, with_run_id: bool = True) -> dict[str, str | None]:
    """Workflow arguments and their defaults (None: required at submission)."""
    params: dict[str, str | None] = {
        "dataset": None, "output": None, "run_id": None, "num_shards": "4", "model": "tiny",
        "kv_store": KV_STORE_FROM_CONFIGMAP, "steps": "50", "guidance": "5.0",
        "gpu_image": settings.gpu_image, "tools_image": settings.tools_image,
    }
    if not with_run_id:
        del params["run_id"]
    return params


def _step(step: str, image: str, pool: Pool, s: ClusterSettings, volume_mounts: list[Any] | None = None) -> Any:
    """A container template running one step program with its pool, credentials and retries."""
    from hera.workflows import (
        ConfigMapEnvFrom,
        Container,
        ExistingVolume,
        FieldEnv,
        Parameter,
        Resources,
        RetryStrategy,
        SecretEnv,
    )
    from hera.workflows import models as m

    inputs = _STEP_INPUTS[step]
    values = {n: _inputs(n) for n in inputs} | _STEP_FIXED.get(step, {})
    uses_weights = bool(s.weights_pvc and pool.gpus)
    return Container(
        name=step,
        image=image,
        command=step_command(step),
        args=step_args(step, **values, weights=s.weights if uses_weights else None),
        inputs=[Parameter(name=n) for n in inputs],
        resources=Resources(cpu_request=pool.cpu, memory_request=pool.memory, memory_limit=pool.memory,
                            gpus=pool.gpus or None),
        node_selector=pool.node_selector or None,
        tolerations=[m.Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect)
                     for t in pool.tolerations] or None,
        env=[SecretEnv(name=k, secret_name=s.s3_secret, secret_key=k) for k in S3_SECRET_KEYS]
        + [FieldEnv(name=POD_IP_ENV, field_path="status.podIP")],
        env_from=[ConfigMapEnvFrom(name=s.endpoints_config_map, optional=True)],
        volumes=[ExistingVolume(name="weights", claim_name=s.weights_pvc, mount_path=s.weights_path,
                                read_only=True)] if uses_weights else None,
        volume_mounts=volume_mounts,
        # Steps skip committed work, so a retry resumes rather than redoes.
        retry_strategy=RetryStrategy(limit=s.retries, retry_policy="Always", expression=retry_when(step),
                                     backoff=m.Backoff(duration=s.backoff, factor=s.backoff_factor,
                                                       max_duration=s.backoff_max)),
    )


def _declare_templates(kind: str, run_id: str, s: ClusterSettings) -> None:
    """Declare the step templates and the DAGs inside the current Hera workflow context."""
    from hera.workflows import DAG, Parameter
    from hera.workflows import models as m

    gpu, tools = "{{workflow.parameters.gpu_image}}", "{{workflow.parameters.tools_image}}"
    shard = _step("shard", tools, s.tools_pool, s)
    ar = _step("ar", gpu, s.ar_pool, s)
    dit = _step("dit", gpu, s.dit_pool, s)
    summary = _step("summary", tools, s.tools_pool, s)

    per_shard_inputs = _STEP_INPUTS["dit"]
    with DAG(name="shard-pipeline", inputs=[Parameter(name=n) for n in per_shard_inputs]) as shard_pipeline:
        given = {n: _inputs(n) for n in per_shard_inputs}
        a = ar(name="ar", arguments={n: given[n] for n in _STEP_INPUTS["ar"]})
        d = dit(name="dit", arguments=given)
        a >> d

    run = {n: _workflow(n) for n in _RUN_VALUES} | {"run_id": run_id}
    with DAG(name="main", parallelism=s.max_parallel_shards):
        sh = shard(name="shard", arguments={"dataset": "{{workflow.parameters.dataset}}", "output": run["output"],
                                            "run_id": run_id, "kind": kind, "model": run["model"],
                                            "num_shards": "{{workflow.parameters.num_shards}}"})
        per = shard_pipeline(name="shards", arguments=run | {"shard": "{{item}}"},
                             with_sequence=m.Sequence(count="{{workflow.parameters.num_shards}}"))
        done = summary(name="summary", arguments={"output": run["output"], "run_id": run_id})
        sh >> per >> done


def _spec(s: ClusterSettings) -> dict[str, Any]:
    """Workflow-level settings shared by the templates and the cron."""
    from hera.workflows import models as m

    return {
        "entrypoint": "main",
        "service_account_name": s.service_account,
        # Keep failed pods (and their logs) for debugging; drop succeeded ones.
        "pod_gc": m.PodGC(strategy="OnPodSuccess", delete_delay_duration="10m"),
        "ttl_strategy": m.TTLStrategy(seconds_after_success=7 * 86400, seconds_after_failure=14 * 86400),
        "security_context": m.PodSecurityContext(run_as_non_root=True, run_as_user=10001, fs_group=10001),
    }


def _arguments(params: dict[str, str | None]) -> list[Any]:
    from hera.workflows import Parameter

    return [Parameter(name=k) if v is None else Parameter(name=k, value=v) for k, v in params.items()]


def workflow_template(pipeline: str, settings: ClusterSettings | None = None) -> Any:
    """The WorkflowTemplate of ``pipeline`` ("batch_edit", "generate_dataset" or "accuracy_sweep")."""
    from hera.workflows import WorkflowTemplate

    if pipeline == "accuracy_sweep":
        return accuracy_sweep_template(settings)
    s = settings or ClusterSettings()
    kind = {"batch_edit": "edit", "generate_dataset": "generate"}[pipeline]
    with WorkflowTemplate(name=TEMPLATES[pipeline], arguments=_arguments(workflow_parameters(s)),
                          **_spec(s)) as wt:
        _declare_templates(kind, "{{workflow.parameters.run_id}}", s)
    return wt


def accuracy_sweep_template(settings: ClusterSettings | None = None) -> Any:
    """One GPU step running an accuracy sweep: spec from a ConfigMap, results on the sweeps PVC."""
    from hera.workflows import DAG, WorkflowTemplate
    from hera.workflows import models as m

    s = settings or ClusterSettings()
    params = {"sweep_id": None, "spec_config_map": "ardit-sweep-spec", "gpu_image": s.gpu_image}
    volumes = [
        # Argo substitutes workflow parameters in spec.volumes, so the spec ConfigMap is per run.
        m.Volume(name="sweep-spec", config_map=m.ConfigMapVolumeSource(name="{{workflow.parameters.spec_config_map}}")),
        m.Volume(name="sweeps", persistent_volume_claim=m.PersistentVolumeClaimVolumeSource(claim_name=s.sweep_pvc)),
    ]
    with WorkflowTemplate(name=TEMPLATES["accuracy_sweep"], arguments=_arguments(params), volumes=volumes,
                          **_spec(s)) as wt:
        mounts = [m.VolumeMount(name="sweep-spec", mount_path=str(PurePosixPath(SWEEP_SPEC).parent), read_only=True),
                  m.VolumeMount(name="sweeps", mount_path=SWEEP_OUTPUT)]
        sweep = _step("sweep", "{{workflow.parameters.gpu_image}}", s.dit_pool, s, volume_mounts=mounts)
        with DAG(name="main"):
            sweep(name="sweep", arguments={"sweep_id": "{{workflow.parameters.sweep_id}}"})
    return wt


def cron_workflow(settings: ClusterSettings | None = None) -> Any:
    """Scheduled dataset generation; one run per slot, never two at once."""
    from hera.workflows import CronWorkflow

    s = settings or ClusterSettings()
    params = workflow_parameters(s, with_run_id=False) | {"dataset": s.cron_dataset, "output": s.cron_output}
    with CronWorkflow(name=CRON_NAME, schedules=[s.cron_schedule], timezone=s.cron_timezone,
                      concurrency_policy="Forbid", starting_deadline_seconds=s.cron_starting_deadline_seconds,
                      successful_jobs_history_limit=3, failed_jobs_history_limit=3,
                      arguments=_arguments(params), **_spec(s)) as cron:
        _declare_templates("generate", CRON_RUN_ID, s)
    return cron


def render_all(settings: ClusterSettings | None = None) -> dict[str, str]:
    """``{file name: YAML}`` for every WorkflowTemplate and the CronWorkflow."""
    docs = {f"{TEMPLATES[p]}.yaml": workflow_template(p, settings).to_yaml() for p in TEMPLATES}
    docs[f"{CRON_NAME}.yaml"] = cron_workflow(settings).to_yaml()
    return docs


def write_all(out_dir: str | Path, settings: ClusterSettings | None = None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_all(settings).items():
        (out / name).write_text(text)
        paths.append(out / name)
    return paths


class SubmitError(RuntimeError):
    """Submission failed; the message says why in words a user can act on."""


def submit(pipeline: str, arguments: dict[str, str], *, host: str, namespace: str, token: str | None = None,
           verify_ssl: bool = True) -> str:
    """Start a Workflow from the installed WorkflowTemplate of ``pipeline``; returns its name."""
    import requests
    from hera.exceptions import HeraException
    from hera.workflows import Parameter, Workflow, WorkflowsService
    from hera.workflows import models as m

    service = WorkflowsService(host=host, token=token, namespace=namespace, verify_ssl=verify_ssl)
    wf = Workflow(generate_name=f"{TEMPLATES[pipeline]}-", namespace=namespace, workflows_service=service,
                  workflow_template_ref=m.WorkflowTemplateRef(name=TEMPLATES[pipeline]),
                  arguments=[Parameter(name=k, value=str(v)) for k, v in arguments.items()])
    try:
        created = wf.create()
    except requests.exceptions.ConnectionError as e:
        reason = getattr(e.args[0], "reason", e) if e.args else e  # urllib3's NewConnectionError, if any
        raise SubmitError(f"cannot reach the Argo server at {host}: {reason}") from e
    except requests.exceptions.RequestException as e:
        raise SubmitError(f"request to the Argo server at {host} failed: {e}") from e
    except HeraException as e:
        raise SubmitError(f"the Argo server at {host} refused the workflow ({e.__class__.__name__}): {e}") from e
    return created.metadata.name
