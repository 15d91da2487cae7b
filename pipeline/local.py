"""One-machine runs: checks -> shard -> (AR -> DiT) per shard -> summary.

The same step functions the containers run (`components.*.run`). Each model copy (a data-parallel
replica: tp x pp GPUs) loads its engine once for the whole job, and its AR and DiT steps share it.
Shards go to the replicas (components/runtime/replicas.py) through a work queue: a free replica
takes the next shard and runs its AR step, then its DiT step. A replica that fails (a rank raised or
died) gives its shard back and retires; the others finish the job. An AR step that ran out of memory
inside a forward of its tp x pp ranks (which cannot retry the batch alone) is not such a failure:
run_step starts the replica's ranks again and runs the step again from the halved budget the run
kept (RESTART_FROM; at most MAX_RESTARTS times, only while the budget shrinks); committed shards stay.
`ardit edit` / `ardit generate` and the accuracy sweeps use it.

    --dp 1, tp x pp = 1   the steps run in this process (as before)
    --dp 1, tp x pp > 1   one RankPool of tp x pp ranks on GPUs 0 .. tp*pp-1
    --dp N                N RankPools (one thread each feeds its pool), replica r on GPUs
                          r*tp*pp .. (r+1)*tp*pp-1; on the CPU N processes
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from components.ar.budget import kept_budget
from components.ar.run import run as ar_run
from components.dit.run import run as dit_run
from components.overlap.run import run as overlap_run

from components.jobconfig import JobConfig

# The step functions a shard runs (module-level functions: rank processes receive them by reference).
STEP_TARGETS = {"ar": ar_run, "dit": dit_run, "overlap": overlap_run}
# What a step's ranks start again from after they failed (run_step's `restart_from`): the AR step's
# budget, halved by an OOM inside a forward. A DiT failure stands.
RESTART_FROM = {"ar": kept_budget, "dit": None, "overlap": kept_budget}


class ReplicasFailed(RuntimeError):
    """Every data-parallel replica failed; the shards left were not committed (a re-run resumes)."""


def run_job(config: JobConfig, *, progress: bool | str = "auto",
            on_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run a whole batch job; returns summary.json's content. Re-running a run id resumes it.

    Generation settings left None come from the model's generation config. Everything the job
    depends on is checked before any work (ConfigError, one line); resuming a run with other
    settings is refused (SettingsConflictError, a ConfigError). `on_start` is called once the
    checks passed, before any work. A run whose shards are all committed does no work and loads
    nothing: its summary comes back with `nothing_to_do` set (and `on_start` is not called).
    `config.data_parallel_size`: model copies (None: as many as the visible GPUs hold, 1 on the
    CPU); `pipeline_parallel_size` x `tensor_parallel_size` GPUs each. `progress`: the bars (see
    components.progress.make_progress)."""
    from components.options import check_engine_options, quantization_option
    from components.preflight import check_job
    from components.run_kv import job_kv_store
    from components.progress import make_progress
    from components.runtime.replicas import ShardStep, run_replicas
    from components.shard.run import run as run_shard
    from components.summary.run import run as run_summary
    from components.summary.run import split_by_replica, summarize

    # "none" (a sweep's, a user's) is no quantization
    config = config.replace(quantization=quantization_option(config.quantization))
    check_engine_options(gpu_memory_utilization=config.gpu_memory_utilization,
                         max_num_batched_tokens=config.max_num_batched_tokens)
    start_s = process_age_s()
    t_checks = time.perf_counter()
    plan = check_job(config)
    checks_s = time.perf_counter() - t_checks
    gen, layout = plan["generation"], plan["layout"]
    if plan["finished"]:
        summary = layout.read_json(layout.summary_key) or run_summary(config.output, config.run_id)
        return {**summary, "nothing_to_do": True}
    if on_start is not None:
        on_start()
    count_tokens, is_supported_size, max_prompt_tokens = plan["validators"]
    t0 = time.perf_counter()
    state = plan["state"]  # what the checks read of the run (its manifest matched this job's sharding)
    manifest = state.manifest or run_shard(config.dataset, config.output, config.run_id, plan["num_shards"],
                                           config.kind, count_tokens=count_tokens, is_supported_size=is_supported_size,
                                           max_prompt_tokens=max_prompt_tokens)
    layout.remember_settings("ar", plan["settings"]["ar"], state.settings["ar"])
    layout.remember_settings("dit", plan["settings"]["dit"], state.settings["dit"])
    if config.ar_from_run:
        _copy_ar_outputs(config.output, config.ar_from_run, config.run_id, manifest["num_shards"])
    # the config the steps take: what the checks resolved, put in once (the device, the K/V store,
    # generation settings filled from the model's generation config)
    steps_config = config.replace(device=plan["device"], **gen,
                                  kv_store=job_kv_store(config.output, config.run_id, config.kv_store))
    overlap = overlaps(config, plan["device"])

    def shard_steps(shard: int) -> list[ShardStep]:
        step = {"config": steps_config, "shard": shard}
        if config.ar_from_run:
            steps = {"dit": step}
        elif overlap:  # one step: the shard's AR and DiT at once on the copy's engine (and the next shards')
            steps = {"overlap": {**step, **({"then": chained} if chained else {})}}
        else:
            steps = {"ar": step, "dit": step}
        return [(STEP_TARGETS[name], kwargs, RESTART_FROM[name]) for name, kwargs in steps.items()]

    todo = state.todo(manifest["num_shards"])  # resume: the rest
    dp = min(plan["data_parallel_size"], max(len(todo), 1))  # no replica without a shard to take
    asked = config.data_parallel_size
    if asked is not None and dp < asked:
        hint = (f"--num-shards {asked} or more gives each one work" if manifest["num_rows"] >= asked
                else f"the dataset has {manifest['num_rows']} row(s)")
        print(f"--data-parallel-size {asked}: {len(todo)} shard(s) to run, so {dp} model "
              f"cop{'y' if dp == 1 else 'ies'} ({hint}; a copy without a shard would load the model for nothing)",
              file=sys.stderr, flush=True)
    # one overlapped copy runs every shard in one step: its AR goes on to the next shard while its DiT
    # finishes the last one's rows (components/overlap/run.py `then`)
    chained = todo[1:] if overlap and dp == 1 else []
    with make_progress(progress, job_steps=len(todo) * (1 if config.ar_from_run else 2), replicas=dp) as bars:
        replicas = run_replicas(todo[:1] if chained else todo, shard_steps, bars, dp, config.tensor_parallel_size,
                                config.pipeline_parallel_size, plan["device"])
    if chained and not replicas.left:
        replicas.ran.update({k: 0 for k in chained})
    summary = summarize(layout)
    split_by_replica(summary, replicas.ran, dp)
    summary["data_parallel"] = {"replicas": dp, "failed": replicas.failed}
    # where the seconds outside the job's clock (wall_s: the manifest's creation to the last commit) go
    summary["start_s"] = round(start_s, 3) if start_s is not None else None  # the process's start to the checks
    summary["checks_s"] = round(checks_s, 3)  # before the job's clock starts
    summary["close_s"] = round(max(replicas.close_s.values()), 3) if replicas.close_s else None  # ranks stopping
    layout.write_json(layout.summary_key, summary)
    if replicas.left:
        raise ReplicasFailed(f"every data-parallel replica failed ({'; '.join(f['error'] for f in replicas.failed)}); "
                             f"shard(s) {replicas.left} were not committed: run the same command again to resume")
    summary.setdefault("wall_s", round(time.perf_counter() - t0, 3))
    return summary


def overlaps(config: JobConfig, device: str) -> bool:
    """Whether the job runs each shard's AR and DiT steps at once (components/overlap/run.py):
    `--overlap on`, or `auto` on a GPU where a model copy is one process (tp x pp = 1). A DiT that
    takes another run's AR outputs has no AR beside it. On one H200 at full size the overlapped job
    beat the job in turn (docs/benchmarks.md); on a CPU the two threads would share its cores."""
    one_rank = config.tensor_parallel_size * config.pipeline_parallel_size == 1
    if config.ar_from_run or not one_rank or config.overlap == "off":
        return False
    return config.overlap == "on" or device.startswith("cuda")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux; None elsewhere): the interpreter's start and the
    imports before a job's checks, which no clock inside the process saw begin."""
    import os
    from pathlib import Path

    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime: ticks after boot
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return None


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
