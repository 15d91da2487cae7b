"""One-machine runs: checks -> shard -> (AR -> DiT) per shard -> summary, in this process.

The same step functions the containers run (`components.*.run`), called in order with one engine
loaded once. `ardit edit` / `ardit generate` and the accuracy sweeps use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def run_job(dataset: str, output: str, run_id: str, *, kind: str = "edit", num_shards: int = 1,
            model: str = "tiny", weights: str | None = None, dummy_weights: bool = False,
            tensor_parallel_size: int = 1, quantization: str | None = None, kv_store: str | None = None,
            steps: int | None = None, guidance: float | None = None, flow_shift: float | None = None, seed: int = 0,
            kv_reuse: bool = True, dtype: str | None = None, temperature: float | None = None,
            top_k: int | None = None, top_p: float | None = None, greedy: bool = False, bot_task: str | None = None,
            system_prompt: str | None = None, batch_size: int | str = "auto", max_new_tokens: int | None = None,
            device: str = "auto", save_latents: bool = False, ar_from_run: str | None = None, step_cache: float = 0.0,
            batch_invariant: bool = False, gpu_memory_utilization: float = 0.9,
            max_num_batched_tokens: int | None = None, progress: bool | str = "auto",
            on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run a whole batch job; returns summary.json's content. Re-running a run id resumes it.

    Generation settings left None come from the model's generation config. Everything the job
    depends on is checked before any work (ConfigError, one line); resuming a run with other
    settings is refused (SettingsConflictError, a ConfigError). `on_start` is called once the
    checks passed, before any work. A run whose shards are all committed does no work and loads
    nothing: its summary comes back with `nothing_to_do` set (and `on_start` is not called)."""
    from components.preflight import check_job
    from components.progress import make_progress
    from components.shard.run import run as run_shard
    from components.steps import check_bench_cot, check_engine_options, quantization_option, rank_pool, run_step
    from components.summary.run import run as run_summary

    quantization = quantization_option(quantization)  # "none" (a sweep's, a user's) is no quantization
    check_engine_options(gpu_memory_utilization=gpu_memory_utilization, max_num_batched_tokens=max_num_batched_tokens)
    check_bench_cot(model, weights, dummy_weights)
    generation = dict(steps=steps, guidance=guidance, flow_shift=flow_shift, bot_task=bot_task,
                      system_prompt=system_prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                      top_k=top_k, top_p=top_p)
    plan = check_job(dataset=dataset, output=output, run_id=run_id, kind=kind, num_shards=num_shards, model=model,
                     weights=weights, dummy_weights=dummy_weights, tensor_parallel_size=tensor_parallel_size,
                     quantization=quantization, kv_store=kv_store, kv_reuse=kv_reuse, device=device, dtype=dtype,
                     seed=seed, batch_size=batch_size, generation=generation, greedy=greedy,
                     ar_from_run=ar_from_run, step_cache=step_cache, batch_invariant=batch_invariant)
    gen, layout = plan["generation"], plan["layout"]
    if plan["finished"]:
        return {**(layout.read_json(layout.summary_key) or run_summary(output, run_id)), "nothing_to_do": True}
    if on_start is not None:
        on_start()
    count_tokens, is_supported_size, max_prompt_tokens = plan["validators"]
    t0 = time.perf_counter()
    manifest = run_shard(dataset, output, run_id, num_shards, kind, count_tokens=count_tokens,
                         is_supported_size=is_supported_size, max_prompt_tokens=max_prompt_tokens)
    layout.remember_settings("ar", plan["settings"]["ar"])
    layout.remember_settings("dit", plan["settings"]["dit"])
    if ar_from_run:
        _copy_ar_outputs(output, ar_from_run, run_id, manifest["num_shards"])
    engine = dict(model=model, weights=weights, dummy_weights=dummy_weights,
                  tensor_parallel_size=tensor_parallel_size, quantization=quantization, kv_store=kv_store,
                  device=plan["device"], dtype=dtype, seed=seed)
    todo = [k for k in range(manifest["num_shards"]) if not layout.is_committed(k)]  # resume: the rest
    # at TP > 1 the steps run on rank processes that live for the whole job: each rank loads its
    # slice of the engine once, and AR and DiT steps of every shard share it
    with make_progress(progress, job_steps=len(todo) * (1 if ar_from_run else 2)) as bars, \
            rank_pool(tensor_parallel_size if todo else 1, plan["device"]) as pool:
        for shard in todo:
            if not ar_from_run:
                run_step("components.ar.run:run", dict(
                    output=output, run_id=run_id, shard=shard, batch_size=batch_size, export_kv=kv_reuse,
                    batch_invariant=batch_invariant, gpu_memory_utilization=gpu_memory_utilization,
                    max_num_batched_tokens=max_num_batched_tokens,
                    **{k: gen[k] for k in ("bot_task", "system_prompt", "max_new_tokens", "temperature", "top_k",
                                           "top_p")}, **engine), bars, pool=pool)
            run_step("components.dit.run:run", dict(
                output=output, run_id=run_id, shard=shard, steps=gen["steps"], guidance=gen["guidance"],
                flow_shift=gen["flow_shift"], kv_reuse=kv_reuse, save_latents=save_latents, step_cache=step_cache,
                **engine), bars, pool=pool)
    summary = run_summary(output, run_id)
    summary.setdefault("wall_s", round(time.perf_counter() - t0, 3))
    return summary


def run_status(output: str, run_id: str) -> dict[str, Any]:
    """What a run has committed so far (for an interrupted job's message): shards committed,
    and rows recorded in the shards that are not."""
    from components.data.runs import RunLayout

    layout = RunLayout.open(output, run_id)
    manifest = layout.read_json(layout.manifest_key)
    if manifest is None:
        return {"sharded": False, "num_shards": 0, "committed": [], "rows_recorded": 0, "rows_total": 0}
    committed, recorded = [], 0
    for k in range(manifest["num_shards"]):
        if layout.is_committed(k):
            committed.append(k)
        else:
            recorded += len(layout.completed_rows(k))
    return {"sharded": True, "num_shards": manifest["num_shards"], "committed": committed,
            "rows_recorded": recorded, "rows_total": manifest["num_rows"]}


def _copy_ar_outputs(output: str, source_run: str, run_id: str, num_shards: int) -> None:
    """Hold the AR tokens fixed: take another run's ar.parquet (its KV was consumed by its DiT,
    so this run recomputes the prefix and says so)."""
    import pyarrow as pa

    from components.data.runs import RunLayout

    src, dst = RunLayout.open(output, source_run), RunLayout.open(output, run_id)
    for shard in range(num_shards):
        table = src.read_table(src.ar_key(shard))
        rows = table.to_pylist()
        for r in rows:
            if r["status"] == "ok":
                r["kv_key"], r["kv_error"] = None, f"AR outputs taken from run {source_run}"
        dst.write_table(dst.ar_key(shard), pa.Table.from_pylist(rows, schema=table.schema))
