"""KFP v2 pipelines: shard -> ParallelFor(shard: AR -> DiT) -> summary.

Each step is a containerized component running exactly the step program's command line
(pipeline.cluster.step_args). Cluster properties (pools, secrets, images) are compile-time
ClusterSettings; per-run values are pipeline parameters. kfp is imported inside the builders so
``import pipeline`` stays light.
"""

# no `from __future__ import annotations`: kfp reads the component signatures as real types

from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from pipeline.cluster import (
    ENDPOINT_KEYS,
    KV_STORE_FROM_CONFIGMAP,
    POD_IP_ENV,
    S3_SECRET_KEYS,
    SWEEP_OUTPUT,
    SWEEP_SPEC,
    ClusterSettings,
    Pool,
    step_args,
    step_command,
)

PIPELINES = ("batch_edit", "generate_dataset", "accuracy_sweep")


def _components(settings: ClusterSettings) -> dict[str, Any]:
    from kfp import dsl

    weights = settings.weights

    @dsl.container_component
    def shard_indices(num_shards: int, indices: dsl.OutputPath(list)):
        """[0, ..., N-1] as a list output for ParallelFor (a pipeline int cannot be range()d)."""
        code = "import json,sys; open(sys.argv[2],'w').write(json.dumps(list(range(int(sys.argv[1])))))"
        return dsl.ContainerSpec(image=settings.tools_image, command=["python", "-c", code], args=[num_shards, indices])

    @dsl.container_component
    def shard(dataset: str, output: str, run_id: str, num_shards: int, kind: str, model: str):
        args = step_args("shard", dataset=dataset, output=output, run_id=run_id, num_shards=num_shards, kind=kind,
                         model=model)
        return dsl.ContainerSpec(image=settings.tools_image, command=step_command("shard"), args=args)

    @dsl.container_component
    def ar(output: str, run_id: str, shard: int, model: str, kv_store: str):
        args = step_args("ar", output=output, run_id=run_id, shard=shard, model=model, weights=weights, kv_store=kv_store)
        return dsl.ContainerSpec(image=settings.gpu_image, command=step_command("ar"), args=args)

    @dsl.container_component
    def dit(output: str, run_id: str, shard: int, model: str, kv_store: str, steps: int, guidance: float):
        args = step_args("dit", output=output, run_id=run_id, shard=shard, model=model, weights=weights,
                         kv_store=kv_store, steps=steps, guidance=guidance)
        return dsl.ContainerSpec(image=settings.gpu_image, command=step_command("dit"), args=args)

    @dsl.container_component
    def summary(output: str, run_id: str):
        return dsl.ContainerSpec(image=settings.tools_image, command=step_command("summary"),
                                 args=step_args("summary", output=output, run_id=run_id))

    @dsl.container_component
    def sweep(sweep_id: str):
        return dsl.ContainerSpec(image=settings.gpu_image, command=step_command("sweep"),
                                 args=step_args("sweep", spec=SWEEP_SPEC, output=SWEEP_OUTPUT, sweep_id=sweep_id))

    return {"shard_indices": shard_indices, "shard": shard, "ar": ar, "dit": dit, "summary": summary,
            "sweep": sweep}


def _place(task: Any, pool: Pool, settings: ClusterSettings, image: Any, side_effects: bool = True,
           retry: bool = True) -> Any:
    """Resources, node pool, credentials, endpoints, retries and caching of one step task."""
    from kfp import kubernetes

    task.set_container_image(image)
    task.set_cpu_request(pool.cpu).set_memory_request(pool.memory).set_memory_limit(pool.memory)
    if pool.gpus:
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(pool.gpus)
    for key, value in pool.node_selector.items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    for t in pool.tolerations:
        kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
    if not side_effects:
        return task
    kubernetes.use_secret_as_env(task, secret_name=settings.s3_secret, secret_key_to_env={k: k for k in S3_SECRET_KEYS})
    kubernetes.use_config_map_as_env(task, config_map_name=settings.endpoints_config_map,
                                     config_map_key_to_env={k: k for k in ENDPOINT_KEYS}, optional=True)
    kubernetes.use_field_path_as_env(task, env_name=POD_IP_ENV, field_path="status.podIP")
    if settings.weights_pvc and pool.gpus:
        kubernetes.mount_pvc(task, pvc_name=settings.weights_pvc, mount_path=settings.weights_path)
    # Steps write to the object store and skip committed work on re-run, so retrying is safe,
    # and a cached "success" would skip writes that a fresh run needs.
    if retry:
        task.set_retry(num_retries=settings.retries, backoff_duration=settings.backoff,
                       backoff_factor=settings.backoff_factor, backoff_max_duration=settings.backoff_max)
    task.set_caching_options(False)
    return task


def _shard_ar_dit_summary(c: dict[str, Any], settings: ClusterSettings, kind: str, *, dataset: Any, output: Any,
                          run_id: Any, num_shards: Any, model: Any, kv_store: Any, steps: Any, guidance: Any,
                          gpu_image: Any, tools_image: Any) -> None:
    """The DAG both pipelines share (called inside a @dsl.pipeline body)."""
    from kfp import dsl

    sharded = _place(c["shard"](dataset=dataset, output=output, run_id=run_id, num_shards=num_shards, kind=kind,
                                model=model),
                     settings.tools_pool, settings, tools_image).set_display_name("shard")
    indices = _place(c["shard_indices"](num_shards=num_shards), settings.tools_pool, settings, tools_image,
                     side_effects=False).set_display_name("shard-indices")
    with dsl.ParallelFor(items=indices.outputs["indices"], parallelism=settings.max_parallel_shards) as k:
        ar = _place(c["ar"](output=output, run_id=run_id, shard=k, model=model, kv_store=kv_store),
                    settings.ar_pool, settings, gpu_image).set_display_name("ar").after(sharded)
        dit = _place(c["dit"](output=output, run_id=run_id, shard=k, model=model, kv_store=kv_store,
                              steps=steps, guidance=guidance),
                     settings.dit_pool, settings, gpu_image).set_display_name("dit").after(ar)
    _place(c["summary"](output=output, run_id=run_id), settings.tools_pool, settings, tools_image) \
        .set_display_name("summary").after(dit)


def build_pipelines(settings: ClusterSettings | None = None) -> dict[str, Callable]:
    """The KFP pipeline functions for these settings, by name."""
    from kfp import dsl

    s = settings or ClusterSettings()
    c = _components(s)

    @dsl.pipeline(name="ardit-batch-edit", description="Edit every row of a dataset: shard -> AR -> DiT -> summary")
    def batch_edit(dataset: str, output: str, run_id: str, num_shards: int = 4, model: str = "tiny",
                   kv_store: str = KV_STORE_FROM_CONFIGMAP, steps: int = 50, guidance: float = 5.0,
                   gpu_image: str = s.gpu_image, tools_image: str = s.tools_image):
        _shard_ar_dit_summary(c, s, "edit", dataset=dataset, output=output, run_id=run_id, num_shards=num_shards,
                              model=model, kv_store=kv_store, steps=steps, guidance=guidance,
                              gpu_image=gpu_image, tools_image=tools_image)

    @dsl.pipeline(name="ardit-generate-dataset", description="Generate images for a prompt dataset")
    def generate_dataset(dataset: str, output: str, run_id: str, num_shards: int = 4, model: str = "tiny",
                         kv_store: str = KV_STORE_FROM_CONFIGMAP, steps: int = 50, guidance: float = 5.0,
                         gpu_image: str = s.gpu_image, tools_image: str = s.tools_image):
        _shard_ar_dit_summary(c, s, "generate", dataset=dataset, output=output, run_id=run_id,
                              num_shards=num_shards, model=model, kv_store=kv_store, steps=steps,
                              guidance=guidance, gpu_image=gpu_image, tools_image=tools_image)

    @dsl.pipeline(name="ardit-accuracy-sweep",
                  description="Run an accuracy sweep (spec from a ConfigMap, results on the sweeps PVC)")
    def accuracy_sweep(sweep_id: str, spec_config_map: str = "ardit-sweep-spec", gpu_image: str = s.gpu_image):
        from kfp import kubernetes

        # No retry: KFP retries any failure, and the sweep exits 1 when a gate fails (a result).
        task = _place(c["sweep"](sweep_id=sweep_id), s.dit_pool, s, gpu_image, retry=False).set_display_name("sweep")
        kubernetes.use_config_map_as_volume(task, config_map_name=spec_config_map,
                                            mount_path=str(PurePosixPath(SWEEP_SPEC).parent))
        kubernetes.mount_pvc(task, pvc_name=s.sweep_pvc, mount_path=SWEEP_OUTPUT)

    return {"batch_edit": batch_edit, "generate_dataset": generate_dataset, "accuracy_sweep": accuracy_sweep}


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
