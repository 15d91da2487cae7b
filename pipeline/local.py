"""One-machine runs: shard -> (AR -> DiT) per shard -> summary, in this process.

The same step functions the containers run (`components.*.run`), called in order with one engine
loaded once. `ardit edit` / `ardit generate` and the accuracy sweeps use it.
"""

from __future__ import annotations

import time
from typing import Any

from components.steps import model_validators, resolve_device


def run_job(dataset: str, output: str, run_id: str, *, kind: str = "edit", num_shards: int = 1,
            model: str = "tiny", weights: str | None = None, kv_store: str | None = None, steps: int = 20,
            guidance: float = 5.0, flow_shift: float = 3.0, seed: int = 0, kv_reuse: bool = True,
            dtype: str | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
            bot_task: str = "think_recaption", system_prompt: str = "en_unified", batch_size: int = 8,
            max_new_tokens: int = 48, device: str = "auto", save_latents: bool = False,
            ar_from_run: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Run a whole batch job; returns summary.json's content. Re-running a run id resumes it."""
    from components.ar.run import run as run_ar
    from components.dit.run import run as run_dit
    from components.shard.run import run as run_shard
    from components.summary.run import run as run_summary

    device = resolve_device(device)
    count_tokens, is_supported_size, max_prompt_tokens = model_validators(model)
    t0 = time.perf_counter()
    manifest = run_shard(dataset, output, run_id, num_shards, kind, count_tokens=count_tokens,
                         is_supported_size=is_supported_size, max_prompt_tokens=max_prompt_tokens)
    if ar_from_run:
        _copy_ar_outputs(output, ar_from_run, run_id, manifest["num_shards"])
    engine = dict(model=model, weights=weights, kv_store=kv_store, device=device, dtype=dtype, seed=seed)
    with _progress(progress) as bars:
        for shard in range(manifest["num_shards"]):
            if not ar_from_run:
                run_ar(output, run_id, shard, batch_size=batch_size, bot_task=bot_task, system_prompt=system_prompt,
                       max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       export_kv=kv_reuse, progress=bars, **engine)
            run_dit(output, run_id, shard, steps=steps, guidance=guidance, flow_shift=flow_shift, kv_reuse=kv_reuse,
                    save_latents=save_latents, progress=bars, **engine)
    summary = run_summary(output, run_id)
    summary.setdefault("wall_s", time.perf_counter() - t0)
    return summary


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


class _progress:
    """A rich progress display (or nothing) that the steps add their bars to."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bars = None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), transient=False)
        self.bars.__enter__()
        return self.bars

    def __exit__(self, *exc) -> None:
        if self.bars is not None:
            self.bars.__exit__(*exc)
