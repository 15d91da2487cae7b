"""KFP v2 pipelines: shard -> ParallelFor(shard: AR -> DiT) -> summary, and the accuracy sweep.

Each step is a containerized component running exactly the step program's command line
(pipeline.cluster.step_command / step_args) behind pipeline.launch. Cluster properties (pools,
secrets, images) are compile-time ClusterSettings; per-run values are pipeline parameters with
the names and defaults of pipeline.cluster.RUN_PARAMETERS.

Two things KFP cannot express the way Argo does:
  * retries that skip exit code 2: KFP retries every failure, so its tasks carry no KFP retry and
    the launcher applies the shared RetryPolicy inside the pod (eviction or node loss is not
    retried: re-submit the same run_id, which resumes);
  * a PVC whose name may be empty: the DAG is built twice, under dsl.If / dsl.Else on
    ``weights_pvc``.
kfp is imported inside the builders so ``import pipeline`` stays light.
"""

# no `from __future__ import annotations`: kfp reads the component signatures as real types

from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from pipeline.cluster import (
    ENDPOINT_KEYS,
    GPU_STEPS,
    KV_CLIENT_LABEL,
    KV_STORE_FROM_CONFIGMAP,
    MODEL_STEPS,
    POD_IP_ENV,
    RUN_AS_USER,
    S3_SECRET_KEYS,
    SHM_MOUNT,
    STEP_IMAGE,
    SWEEP_OUTPUT,
    SWEEP_SPEC,
    WEIGHTS_MOUNT,
    ClusterSettings,
    Pool,
    step_args,
    step_command,
)

PIPELINES = ("batch_edit", "generate_dataset", "accuracy_sweep")
SCHEDULED_PIPELINE = "generate_dataset_scheduled"

# Turns the schedule time KFP hands a recurring run (RFC 3339) into the run id the Argo cron uses
# for the same slot (scheduled-20261122T020000Z), and into the run's deadline (Unix time: the slot
# plus argv[3] seconds, cron_deadline_seconds), which every step's launcher enforces (--not-after):
# KFP has no whole-run deadline. A run that was not scheduled has no such time.
_SCHEDULED_RUN_ID = (
    "import datetime,re,sys\n"
    "t = sys.argv[1].strip()\n"
    "if not t or t.startswith('{{'):\n"
    "    print('error: not a scheduled run (no schedule time): start generate_dataset with a run_id instead',"
    " file=sys.stderr)\n"
    "    sys.exit(2)\n"
    "open(sys.argv[2], 'w').write('scheduled-' + re.sub('[^0-9A-Za-z]', '', t))\n"
    "slot = datetime.datetime.fromisoformat(t.replace('Z', '+00:00')).timestamp()\n"
    "open(sys.argv[4], 'w').write(str(int(slot) + int(sys.argv[3])))\n"
)


def _pool(step: str, s: ClusterSettings) -> Pool:
    return {"ar": s.ar_pool, "dit": s.dit_pool, "sweep": s.dit_pool}.get(step, s.tools_pool)


def _command(step: str, s: ClusterSettings, weights_pvc: Any = None, not_after: Any = None) -> list:
    return step_command(step, weights_pvc=weights_pvc if step in MODEL_STEPS else None,
                        retry=s.retry_policy(step), attempt_timeout=s.deadline(step), not_after=not_after)


def _components(s: ClusterSettings) -> dict[str, Any]:
    from kfp import dsl

    def image(step: str) -> str:
        return s.gpu_image if STEP_IMAGE[step] == "gpu" else s.tools_image

    @dsl.container_component
    def shard_indices(num_shards: int, indices: dsl.OutputPath(list)):
        """[0, ..., N-1] as a list output for ParallelFor (a pipeline int cannot be range()d)."""
        code = "import json,sys; open(sys.argv[2],'w').write(json.dumps(list(range(int(sys.argv[1])))))"
        return dsl.ContainerSpec(image=s.tools_image, command=["python", "-c", code], args=[num_shards, indices])

    @dsl.container_component
    def gpus_per_model(tensor_parallel_size: int, pipeline_parallel_size: int, gpus: dsl.OutputPath(int)):
        """tp x pp: the GPUs of one model copy, which each AR / DiT pod asks for (KFP cannot multiply
        two pipeline parameters itself)."""
        code = "import sys; open(sys.argv[3],'w').write(str(int(sys.argv[1]) * int(sys.argv[2])))"
        return dsl.ContainerSpec(image=s.tools_image, command=["python", "-c", code],
                                 args=[tensor_parallel_size, pipeline_parallel_size, gpus])

    @dsl.container_component
    def scheduled_run_id(schedule_time: str, run_id: dsl.OutputPath(str), not_after: dsl.OutputPath(str)):
        return dsl.ContainerSpec(image=s.tools_image, command=["python", "-c", _SCHEDULED_RUN_ID],
                                 args=[schedule_time, run_id, str(s.cron_deadline_seconds), not_after])

    @dsl.container_component
    def shard(dataset: str, output: str, run_id: str, num_shards: int, kind: str, model: str, weights_pvc: str,
              not_after: str):
        args = step_args("shard", dataset=dataset, output=output, run_id=run_id, num_shards=num_shards, kind=kind,
                         model=model)
        return dsl.ContainerSpec(image=image("shard"), command=_command("shard", s, weights_pvc, not_after), args=args)

    @dsl.container_component
    def ar(output: str, run_id: str, shard: int, model: str, weights_pvc: str, tensor_parallel_size: int,
           pipeline_parallel_size: int, gpus: int, quantization: str, kv_store: str, bot_task: str,
           batch_invariant: str, not_after: str):
        args = step_args("ar", output=output, run_id=run_id, shard=shard, model=model,
                         tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                         quantization=quantization, kv_store=kv_store, bot_task=bot_task,
                         batch_invariant=batch_invariant)
        return dsl.ContainerSpec(image=image("ar"), command=_command("ar", s, weights_pvc, not_after), args=args)

    @dsl.container_component
    def dit(output: str, run_id: str, shard: int, model: str, weights_pvc: str, tensor_parallel_size: int,
            pipeline_parallel_size: int, gpus: int, quantization: str, kv_store: str, steps: str, guidance: str,
            step_cache: str, not_after: str):
        args = step_args("dit", output=output, run_id=run_id, shard=shard, model=model,
                         tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                         quantization=quantization, kv_store=kv_store, steps=steps, guidance=guidance,
                         step_cache=step_cache)
        return dsl.ContainerSpec(image=image("dit"), command=_command("dit", s, weights_pvc, not_after), args=args)

    @dsl.container_component
    def summary(output: str, run_id: str, not_after: str):
        return dsl.ContainerSpec(image=image("summary"), command=_command("summary", s, not_after=not_after),
                                 args=step_args("summary", output=output, run_id=run_id))

    @dsl.container_component
    def sweep(sweep_id: str):
        return dsl.ContainerSpec(image=image("sweep"), command=_command("sweep", s),
                                 args=step_args("sweep", spec=SWEEP_SPEC, output=SWEEP_OUTPUT, sweep_id=sweep_id))

    return {"shard_indices": shard_indices, "gpus_per_model": gpus_per_model,
            "scheduled_run_id": scheduled_run_id, "shard": shard, "ar": ar,
            "dit": dit, "summary": summary, "sweep": sweep}


def _place(task: Any, step: str | None, s: ClusterSettings, *, weights_pvc: Any = None,
           gpus: Any = None) -> Any:
    """Resources, node pool, credentials, endpoints, security, deadline and caching of one task.

    ``step`` None: a pure helper (no credentials, no endpoints). ``gpus``: what a GPU step asks for
    (a pipeline parameter or a task output)."""
    from kfp import kubernetes

    pool = _pool(step or "", s)
    task.set_cpu_request(pool.cpu).set_memory_request(pool.memory).set_memory_limit(pool.memory)
    if step in GPU_STEPS:
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(gpus)
        kubernetes.empty_dir_mount(task, volume_name="shm", mount_path=SHM_MOUNT, medium="Memory",
                                   size_limit=pool.shm_size)
    for key, value in pool.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for t in pool.tolerations:
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
    kubernetes.set_security_context(task, run_as_user=RUN_AS_USER, run_as_group=RUN_AS_USER, run_as_non_root=True)
    if s.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(s.image_pull_secrets))
    # A cached "success" would skip writes that a fresh run needs.
    task.set_caching_options(False)
    if step is None:
        kubernetes.set_timeout(task, 600)
        return task
    kubernetes.use_secret_as_env(task, secret_name=s.s3_secret, secret_key_to_env={k: k for k in S3_SECRET_KEYS})
    kubernetes.use_config_map_as_env(task, config_map_name=s.endpoints_config_map,
                                     config_map_key_to_env={k: k for k in ENDPOINT_KEYS}, optional=True)
    kubernetes.use_field_path_as_env(task, env_name=POD_IP_ENV, field_path="status.podIP")
    kubernetes.add_pod_label(task, label_key=KV_CLIENT_LABEL[0], label_value=KV_CLIENT_LABEL[1])
    if weights_pvc is not None:
        kubernetes.mount_pvc(task, pvc_name=weights_pvc, mount_path=WEIGHTS_MOUNT)
    # The pod runs every attempt the launcher makes (RetryPolicy): its deadline covers them all.
    policy = s.retry_policy(step)
    kubernetes.set_timeout(task, policy.window_seconds(s.deadline(step)))
    return task


def _shard_ar_dit_summary(c: dict[str, Any], s: ClusterSettings, kind: str, p: dict[str, Any],
                          weights_pvc: Any) -> None:
    """The DAG both batch pipelines share (called inside a @dsl.pipeline body); ``p``: pipeline inputs.

    ``weights_pvc``: the PVC channel to mount on the model steps, or None for no PVC. ``p["not_after"]``
    (scheduled runs): the run's deadline, which every step's launcher enforces; "" otherwise."""
    from kfp import dsl

    not_after = p.get("not_after", "")
    sharded = _place(c["shard"](dataset=p["dataset"], output=p["output"], run_id=p["run_id"],
                                num_shards=p["num_shards"], kind=kind, model=p["model"],
                                weights_pvc=p["weights_pvc"], not_after=not_after),
                     "shard", s, weights_pvc=weights_pvc).set_display_name("shard")
    indices = _place(c["shard_indices"](num_shards=p["num_shards"]), None, s).set_display_name("shard-indices")
    gpus = _place(c["gpus_per_model"](tensor_parallel_size=p["tensor_parallel_size"],
                                      pipeline_parallel_size=p["pipeline_parallel_size"]), None, s) \
        .set_display_name("gpus-per-model").outputs["gpus"]
    # `gpus` is also an input of the AR / DiT tasks (their command does not use it), so KFP brings it
    # into the loop, where the accelerator count can refer to it
    common = {k: p[k] for k in ("output", "run_id", "model", "weights_pvc", "tensor_parallel_size",
                                "pipeline_parallel_size", "quantization", "kv_store")} | {"gpus": gpus,
                                                                                          "not_after": not_after}
    # the fan-out over shards is the data parallelism of a cluster run: one pod per shard step
    with dsl.ParallelFor(items=indices.outputs["indices"], parallelism=s.max_parallel_shards) as k:
        ar = _place(c["ar"](shard=k, bot_task=p["bot_task"], batch_invariant=p["batch_invariant"], **common), "ar", s,
                    weights_pvc=weights_pvc, gpus=gpus).set_display_name("ar").after(sharded)
        dit = _place(c["dit"](shard=k, steps=p["steps"], guidance=p["guidance"], step_cache=p["step_cache"],
                              **common), "dit", s, weights_pvc=weights_pvc, gpus=gpus) \
            .set_display_name("dit").after(ar)
    _place(c["summary"](output=p["output"], run_id=p["run_id"], not_after=not_after), "summary", s) \
        .set_display_name("summary").after(dit)


def _both_variants(c: dict[str, Any], s: ClusterSettings, kind: str, p: dict[str, Any]) -> None:
    """The DAG without a weights PVC, or with it mounted: whichever ``weights_pvc`` asks for."""
    from kfp import dsl

    with dsl.If(p["weights_pvc"] == "", name="no-weights-pvc"):
        _shard_ar_dit_summary(c, s, kind, p, weights_pvc=None)
    with dsl.Else(name="weights-pvc"):
        _shard_ar_dit_summary(c, s, kind, p, weights_pvc=p["weights_pvc"])


def build_pipelines(settings: ClusterSettings | None = None) -> dict[str, Callable]:
    """The KFP pipeline functions for these settings, by name (PIPELINES and SCHEDULED_PIPELINE)."""
    from kfp import dsl

    s = settings or ClusterSettings()
    c = _components(s)

    # Defaults as in pipeline.cluster.RUN_PARAMETERS (KFP wants them in the signature).
    @dsl.pipeline(name="ardit-batch-edit", description="Edit every row of a dataset: shard -> AR -> DiT -> summary")
    def batch_edit(dataset: str, output: str, run_id: str, num_shards: int = 4, model: str = "tiny",
                   weights_pvc: str = "", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                   quantization: str = "", steps: str = "", guidance: str = "", bot_task: str = "",
                   batch_invariant: str = "", step_cache: str = "", kv_store: str = KV_STORE_FROM_CONFIGMAP):
        _both_variants(c, s, "edit", dict(locals()))

    @dsl.pipeline(name="ardit-generate-dataset", description="Generate images for a prompt dataset")
    def generate_dataset(dataset: str, output: str, run_id: str, num_shards: int = 4, model: str = "tiny",
                         weights_pvc: str = "", tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                         quantization: str = "", steps: str = "", guidance: str = "", bot_task: str = "",
                         batch_invariant: str = "", step_cache: str = "", kv_store: str = KV_STORE_FROM_CONFIGMAP):
        _both_variants(c, s, "generate", dict(locals()))

    @dsl.pipeline(name="ardit-generate-dataset-scheduled",
                  description="generate_dataset for a recurring run: the run id comes from the schedule time")
    def generate_dataset_scheduled(dataset: str, output: str, num_shards: int = 4, model: str = "tiny",
                                   weights_pvc: str = "", tensor_parallel_size: int = 1,
                                   pipeline_parallel_size: int = 1, quantization: str = "", steps: str = "",
                                   guidance: str = "", bot_task: str = "", batch_invariant: str = "",
                                   step_cache: str = "",
                                   kv_store: str = KV_STORE_FROM_CONFIGMAP):
        p = dict(locals())
        run_id = _place(c["scheduled_run_id"](schedule_time=dsl.PIPELINE_JOB_SCHEDULE_TIME_UTC_PLACEHOLDER), None, s)
        run_id.set_display_name("run-id")
        _both_variants(c, s, "generate", p | {"run_id": run_id.outputs["run_id"],
                                              "not_after": run_id.outputs["not_after"]})

    @dsl.pipeline(name="ardit-accuracy-sweep",
                  description="Run an accuracy sweep (spec from a ConfigMap, results on the sweeps PVC)")
    def accuracy_sweep(sweep_id: str, spec_config_map: str = "ardit-sweep-spec", weights_pvc: str = "",
                       tensor_parallel_size: int = 1):
        from kfp import kubernetes

        def one(pvc: Any) -> None:
            task = _place(c["sweep"](sweep_id=sweep_id), "sweep", s, weights_pvc=pvc,
                          gpus=tensor_parallel_size).set_display_name("sweep")
            kubernetes.use_config_map_as_volume(task, config_map_name=spec_config_map,
                                                mount_path=str(PurePosixPath(SWEEP_SPEC).parent))
            kubernetes.mount_pvc(task, pvc_name=s.sweep_pvc, mount_path=SWEEP_OUTPUT)

        with dsl.If(weights_pvc == "", name="no-weights-pvc"):
            one(None)
        with dsl.Else(name="weights-pvc"):
            one(weights_pvc)

    return {"batch_edit": batch_edit, "generate_dataset": generate_dataset, "accuracy_sweep": accuracy_sweep,
            SCHEDULED_PIPELINE: generate_dataset_scheduled}


def compile_pipelines(out_dir: str, settings: ClusterSettings | None = None) -> list[str]:
    """Write ``{out_dir}/{name}.yaml`` (KFP IR) for every pipeline; returns the paths."""
    from pathlib import Path

    from kfp import compiler

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fn in build_pipelines(settings).items():
        path = str(Path(out_dir) / f"{name}.yaml")
        compiler.Compiler().compile(pipeline_func=fn, package_path=path)
        paths.append(path)
    return paths
