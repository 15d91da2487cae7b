"""Argo Workflows definitions built with Hera: WorkflowTemplates for batch edit, dataset
generation and accuracy sweeps, and a CronWorkflow for scheduled generation.

DAG: shard -> fan-out over shard indices (withSequence, bounded by ``parallelism``) of a per-shard
DAG (AR -> DiT) -> summary. Shards are independent, so the AR of one shard overlaps the DiT of
another; the fan-out is the data parallelism of a cluster run (a local job's ``--dp``), and each AR
/ DiT pod asks for one model copy's GPUs, tensor_parallel_size x pipeline_parallel_size. Step templates take every per-run value as an input; only the top DAG binds them, which
lets the CronWorkflow bind ``run_id`` to its scheduled time.

The weights PVC is a run parameter, and a pod cannot mount a PVC with an empty name, so the
pipeline exists twice: ``pipeline`` (no PVC: presets such as tiny) and ``pipeline-weights`` (the
PVC mounted read-only at /weights on every step that reads the model); ``main`` runs the one that
matches ``weights_pvc`` and skips the other.

Images are kustomize names (``ardit-gpu``, ``ardit-tools``): manifests/images sets registry and tag.
hera is imported inside functions.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from pipeline.cluster import (
    GPU_STEPS,
    KV_CLIENT_LABEL,
    MODEL_STEPS,
    POD_IP_ENV,
    RUN_AS_USER,
    RUN_PARAMETERS,
    S3_SECRET_KEYS,
    SHM_MOUNT,
    STEP_IMAGE,
    STEP_INPUTS,
    SWEEP_OUTPUT,
    SWEEP_PARAMETERS,
    SWEEP_SPEC,
    WEIGHTS_MOUNT,
    ClusterSettings,
    Pool,
    RetryPolicy,
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
WEIGHTS_SUFFIX = "-weights"
GPUS_PER_MODEL = ("{{=asInt(inputs.parameters.tensor_parallel_size) * "
                  "asInt(inputs.parameters.pipeline_parallel_size)}}")


def _inputs(name: str) -> str:
    return "{{inputs.parameters." + name + "}}"


def _workflow(name: str) -> str:
    return "{{workflow.parameters." + name + "}}"


def _when_weights(with_weights: bool) -> str:
    return f"'{_workflow('weights_pvc')}' {'!=' if with_weights else '=='} ''"


def _pool(step: str, s: ClusterSettings) -> Pool:
    return {"ar": s.ar_pool, "dit": s.dit_pool, "sweep": s.dit_pool}.get(step, s.tools_pool)


def container_security_context(ipc_lock: bool = False) -> Any:
    """The "restricted" Pod Security Standard, container part; ``ipc_lock``: plus IPC_LOCK (RDMA
    memory registration), which only a namespace enforcing "privileged" admits (manifests/rdma)."""
    from hera.workflows import models as m

    return m.SecurityContext(allow_privilege_escalation=False,
                             capabilities=m.Capabilities(drop=["ALL"], add=["IPC_LOCK"] if ipc_lock else None),
                             run_as_non_root=True)


def _gpu_count_patch(step: str) -> str:
    # Quantities cannot hold a template, so the GPU count goes through podSpecPatch (Argo's way of
    # parameterising resources); it replaces the static count of 1 in the template. A model copy
    # takes tensor_parallel_size x pipeline_parallel_size GPUs (an expression template); the sweep
    # pod is sized by tensor_parallel_size alone.
    gpus = _inputs("tensor_parallel_size")
    if "pipeline_parallel_size" in STEP_INPUTS[step]:
        gpus = GPUS_PER_MODEL
    patch = {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": gpus},
                                                           "requests": {"nvidia.com/gpu": gpus}}}]}
    return json.dumps(patch, separators=(",", ":"))


def _step(step: str, s: ClusterSettings, with_weights: bool = False, volume_mounts: list[Any] | None = None) -> Any:
    """A container template running one step program with its pool, credentials, deadline and retries."""
    from hera.workflows import (
        ConfigMapEnvFrom,
        Container,
        EmptyDirVolume,
        ExistingVolume,
        FieldEnv,
        Parameter,
        Resources,
        RetryStrategy,
        SecretEnv,
    )
    from hera.workflows import models as m

    pool = _pool(step, s)
    inputs = STEP_INPUTS[step]
    values = {n: _inputs(n) for n in inputs} | ({"spec": SWEEP_SPEC, "output": SWEEP_OUTPUT} if step == "sweep" else {})
    gpu = step in GPU_STEPS
    volumes = []
    if gpu:
        volumes.append(EmptyDirVolume(name="shm", mount_path=SHM_MOUNT, medium="Memory", size_limit=pool.shm_size))
    if with_weights:
        volumes.append(ExistingVolume(name="weights", claim_name=_inputs("weights_pvc"), mount_path=WEIGHTS_MOUNT,
                                      read_only=True))
    retry = s.retry_policy(step)
    rdma = gpu and bool(s.rdma_resource)
    return Container(
        name=step + (WEIGHTS_SUFFIX if with_weights else ""),
        image=s.gpu_image if STEP_IMAGE[step] == "gpu" else s.tools_image,
        command=step_command(step, weights_pvc=_inputs("weights_pvc") if step in MODEL_STEPS else None),
        args=step_args(step, **values),
        inputs=[Parameter(name=n) for n in inputs],
        resources=Resources(cpu_request=pool.cpu, memory_request=pool.memory, memory_limit=pool.memory,
                            gpus=1 if gpu else None,
                            custom_resources={"requests": {s.rdma_resource: "1"}, "limits": {s.rdma_resource: "1"}}
                            if rdma else None),
        pod_spec_patch=_gpu_count_patch(step) if gpu else None,
        node_selector=pool.node_selector or None,
        tolerations=[m.Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect)
                     for t in pool.tolerations] or None,
        env=[SecretEnv(name=k, secret_name=s.s3_secret, secret_key=k) for k in S3_SECRET_KEYS]
        + [FieldEnv(name=POD_IP_ENV, field_path="status.podIP")],
        env_from=[ConfigMapEnvFrom(name=s.endpoints_config_map, optional=True)],
        volumes=volumes or None,
        volume_mounts=volume_mounts,
        security_context=container_security_context(ipc_lock=rdma),
        # Per attempt: a hung step is killed and retried instead of blocking the run (and the cron).
        active_deadline_seconds=s.deadline(step),
        # Steps skip committed work, so a retry resumes rather than redoes.
        retry_strategy=RetryStrategy(limit=retry.limit, retry_policy="Always", expression=retry.argo_expression(),
                                     backoff=_backoff(retry, s.deadline(step), s.attempt_queue_seconds)),
    )


# The fields of Argo 3.6's Backoff (the oldest Argo docs/deploy.md supports): no `cap`, which 3.7 added.
ARGO_BACKOFF_FIELDS = ("duration", "factor", "maxDuration")


def _backoff(retry: RetryPolicy, attempt_timeout: int, queue_seconds: int = 0) -> Any:
    """Argo's backoff for ``retry``. ``maxDuration`` is the whole retry window from the first
    attempt's start (a retry due after it is never made, a running one is cut short), so it covers
    every attempt at its deadline, the time each may wait unscheduled, and the delays. Argo 3.6 has
    no per-delay cap, so its delays keep doubling past ``max_backoff_seconds`` (which only KFP's
    launcher applies) and the window counts them uncapped."""
    from hera.workflows import models as m

    return m.Backoff(duration=f"{retry.backoff_seconds}s", factor=retry.factor,
                     max_duration=f"{retry.window_seconds(attempt_timeout, queue_seconds, capped=False)}s")


def _declare_pipeline(kind: str, s: ClusterSettings, summary: Any, with_weights: bool) -> Any:
    """The DAG shard -> shards (AR -> DiT per shard) -> summary, in the current Hera workflow context."""
    from hera.workflows import DAG, Parameter
    from hera.workflows import models as m

    sfx = WEIGHTS_SUFFIX if with_weights else ""
    shard = _step("shard", s, with_weights)
    ar = _step("ar", s, with_weights)
    dit = _step("dit", s, with_weights)

    per_shard = sorted(set(STEP_INPUTS["ar"]) | set(STEP_INPUTS["dit"]))
    with DAG(name="shard-pipeline" + sfx, inputs=[Parameter(name=n) for n in per_shard]) as shard_pipeline:
        a = ar(name="ar", arguments={n: _inputs(n) for n in STEP_INPUTS["ar"]})
        d = dit(name="dit", arguments={n: _inputs(n) for n in STEP_INPUTS["dit"]})
        a >> d

    run_inputs = [n for n in RUN_PARAMETERS]
    with DAG(name="pipeline" + sfx, inputs=[Parameter(name=n) for n in run_inputs],
             parallelism=s.max_parallel_shards) as pipeline:
        given = {n: _inputs(n) for n in run_inputs}
        sh = shard(name="shard", arguments={n: given[n] for n in STEP_INPUTS["shard"] if n != "kind"} | {"kind": kind})
        per = shard_pipeline(name="shards", arguments={n: given[n] for n in per_shard if n != "shard"}
                             | {"shard": "{{item}}"},
                             with_sequence=m.Sequence(count=given["num_shards"]))
        done = summary(name="summary", arguments={"output": given["output"], "run_id": given["run_id"]})
        sh >> per >> done
    return pipeline


def _declare_main(kind: str, run_id: str, s: ClusterSettings) -> None:
    """Both pipeline variants and ``main``, which runs the one that matches ``weights_pvc``."""
    from hera.workflows import DAG

    summary = _step("summary", s)
    plain = _declare_pipeline(kind, s, summary, with_weights=False)
    weighted = _declare_pipeline(kind, s, summary, with_weights=True)
    arguments = {n: _workflow(n) for n in RUN_PARAMETERS} | {"run_id": run_id}
    with DAG(name="main"):
        plain(name="run", arguments=arguments, when=_when_weights(False))
        weighted(name="run" + WEIGHTS_SUFFIX, arguments=arguments, when=_when_weights(True))


def _spec(s: ClusterSettings, deadline: int) -> dict[str, Any]:
    """Workflow-level settings shared by the templates and the cron."""
    from hera.workflows import models as m

    return {
        "entrypoint": "main",
        "service_account_name": s.service_account,
        # The steps call no Kubernetes API: no token in their containers. Argo's own init/wait
        # containers get the executor account's token (they report results to the API).
        "automount_service_account_token": False,
        "executor": m.ExecutorConfig(service_account_name=s.service_account),
        # The NetworkPolicy lets only pods with this label reach the Mooncake servers.
        "pod_metadata": m.Metadata(labels=dict([KV_CLIENT_LABEL])),
        # Keep failed pods (and their logs) for debugging; drop succeeded ones.
        "pod_gc": m.PodGC(strategy="OnPodSuccess", delete_delay_duration="10m"),
        "ttl_strategy": m.TTLStrategy(seconds_after_success=7 * 86400, seconds_after_failure=14 * 86400),
        "security_context": m.PodSecurityContext(run_as_non_root=True, run_as_user=RUN_AS_USER,
                                                 run_as_group=RUN_AS_USER, fs_group=RUN_AS_USER,
                                                 seccomp_profile=m.SeccompProfile(type="RuntimeDefault")),
        "active_deadline_seconds": deadline,
        "image_pull_secrets": [m.LocalObjectReference(name=n) for n in s.image_pull_secrets] or None,
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
    with WorkflowTemplate(name=TEMPLATES[pipeline], arguments=_arguments(RUN_PARAMETERS),
                          **_spec(s, s.workflow_deadline_seconds)) as wt:
        _declare_main(kind, _workflow("run_id"), s)
    return wt


def accuracy_sweep_template(settings: ClusterSettings | None = None) -> Any:
    """One GPU step running an accuracy sweep: spec from a ConfigMap, results on the sweeps PVC."""
    from hera.workflows import DAG, WorkflowTemplate
    from hera.workflows import models as m

    s = settings or ClusterSettings()
    volumes = [
        # Argo substitutes workflow parameters in spec.volumes, so the spec ConfigMap is per run.
        m.Volume(name="sweep-spec", config_map=m.ConfigMapVolumeSource(name=_workflow("spec_config_map"))),
        m.Volume(name="sweeps", persistent_volume_claim=m.PersistentVolumeClaimVolumeSource(claim_name=s.sweep_pvc)),
    ]
    with WorkflowTemplate(name=TEMPLATES["accuracy_sweep"], arguments=_arguments(SWEEP_PARAMETERS), volumes=volumes,
                          **_spec(s, s.retry_policy("sweep").window_seconds(
                              s.deadline("sweep"), s.attempt_queue_seconds, capped=False))) as wt:
        mounts = [m.VolumeMount(name="sweep-spec", mount_path=str(PurePosixPath(SWEEP_SPEC).parent), read_only=True),
                  m.VolumeMount(name="sweeps", mount_path=SWEEP_OUTPUT)]
        variants = {w: _step("sweep", s, with_weights=w, volume_mounts=mounts) for w in (False, True)}
        arguments = {n: _workflow(n) for n in ("sweep_id", "weights_pvc", "tensor_parallel_size")}
        with DAG(name="main"):
            for w, template in variants.items():
                template(name="sweep" + (WEIGHTS_SUFFIX if w else ""), arguments=arguments, when=_when_weights(w))
    return wt


def cron_workflow(settings: ClusterSettings | None = None) -> Any:
    """Scheduled dataset generation; one run per slot, never two at once; ships suspended."""
    from hera.workflows import CronWorkflow

    s = settings or ClusterSettings()
    with CronWorkflow(name=CRON_NAME, schedules=[s.cron_schedule], timezone=s.cron_timezone,
                      concurrency_policy="Forbid", starting_deadline_seconds=s.cron_starting_deadline_seconds,
                      successful_jobs_history_limit=3, failed_jobs_history_limit=3, cron_suspend=s.cron_suspended,
                      arguments=_arguments(s.cron_parameters()), **_spec(s, s.cron_deadline_seconds)) as cron:
        _declare_main("generate", CRON_RUN_ID, s)
    return cron


def render_all(settings: ClusterSettings | None = None, cron: bool = True) -> dict[str, str]:
    """``{file name: YAML}`` for every WorkflowTemplate and (``cron``) the CronWorkflow."""
    docs = {f"{TEMPLATES[p]}.yaml": workflow_template(p, settings).to_yaml() for p in TEMPLATES}
    if cron:
        docs[f"{CRON_NAME}.yaml"] = cron_workflow(settings).to_yaml()
    return docs


def write_all(out_dir: str | Path, settings: ClusterSettings | None = None, cron: bool = True) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render_all(settings, cron).items():
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
