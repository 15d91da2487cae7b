"""AR step: one shard's rows -> CoT, ratio token and prompt KV.

    for each batch of pending rows:
        batched prefill + CoT decode + ratio token          (engine.generate_ar)
        kv.put(run/shard/row, prompt KV)                     (the DiT step reads it)
    ar.parquet: one row per pending input row (ok with the AR record, or error)

Rows whose image is already committed by the DiT step are skipped (resume). ar.parquet is written
once, atomically, at the end; a killed AR step leaves nothing the DiT step would trust.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pyarrow as pa

from components.data.runs import RunLayout
from components.steps import default_kv_store, kv_key, load_engine

AR_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("status", pa.string()),  # ok | error
    ("error", pa.string()),
    ("ar_record", pa.string()),  # AROutput.to_record() as JSON
    ("kv_key", pa.string()),
    ("kv_bytes", pa.int64()),
    ("kv_put_s", pa.float64()),
    ("kv_error", pa.string()),
    ("ar_prefill_s", pa.float64()),
    ("ar_decode_s", pa.float64()),
    ("prompt_tokens", pa.int64()),
    ("generated_tokens", pa.int64()),
])


def run(output: str, run_id: str, shard: int, *, model: str = "tiny", weights: str | None = None,
        kv_store: str | None = None, batch_size: int = 8, bot_task: str = "think_recaption",
        system_prompt: str = "en_unified", max_new_tokens: int = 48, temperature: float = 0.0,
        top_k: int = 0, top_p: float = 1.0, seed: int = 0, device: str = "cpu", dtype: str | None = None,
        export_kv: bool = True, progress: Any = None) -> dict[str, Any]:
    from components.engine import ARRequest, SamplingParams
    from components.kvstore import open_store

    layout = RunLayout.open(output, run_id)
    if layout.is_committed(shard):
        return {"shard": shard, "skipped": "committed"}
    pending = layout.shard_writer(shard).pending()
    existing = _existing_ids(layout, shard)
    if pending and {j.id for j in pending} <= existing:
        return {"shard": shard, "skipped": "ar.parquet covers all pending rows"}

    engine = load_engine(model, weights, device, dtype)
    store = open_store(kv_store or default_kv_store(output, run_id)) if export_kv else None
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens)
    rows: list[dict[str, Any]] = []
    task = progress.add_task(f"AR  shard {shard}", total=len(pending)) if progress else None
    for start in range(0, len(pending), batch_size):
        batch = pending[start:start + batch_size]
        requests = []
        for job in batch:
            try:
                requests.append(ARRequest(job.id, job.text or "", job.pil_images(), job.size_wh() or "auto",
                                          bot_task, system_prompt, job.effective_seed(seed)))
            except Exception as e:  # noqa: BLE001 - one bad row must not sink the shard
                rows.append(_error_row(job.id, f"AR input: {e}"))
        for request, result in zip(requests, _generate(engine, requests, sampling)):
            if isinstance(result, Exception):
                rows.append(_error_row(request.id, f"AR failed: {type(result).__name__}: {result}"))
                continue
            rows.append(_ok_row(result, store, run_id, shard, len(requests)))
        if progress:
            progress.advance(task, len(batch))
    layout.write_table(layout.ar_key(shard), pa.Table.from_pylist(rows, schema=AR_SCHEMA))
    if store:
        store.close()
    return {"shard": shard, "rows": len(rows), "errors": sum(r["status"] != "ok" for r in rows)}


def _generate(engine, requests, sampling) -> list:
    """Outputs for a batch; if the batch fails, rows one by one so a bad row names itself."""
    if not requests:
        return []
    try:
        return engine.generate_ar(requests, sampling)
    except Exception:  # noqa: BLE001
        results = []
        for r in requests:
            try:
                results.append(engine.generate_ar([r], sampling)[0])
            except Exception as e:  # noqa: BLE001
                results.append(e)
        return results


def _ok_row(out, store, run_id: str, shard: int, batch_size: int) -> dict[str, Any]:
    t = out.timings
    row = {"id": out.id, "status": "ok", "error": None, "ar_record": json.dumps(out.to_record()),
           "kv_key": None, "kv_bytes": None, "kv_put_s": None, "kv_error": None,
           # batch times are shared: each row carries its share
           "ar_prefill_s": t["ar_prefill_s"] / batch_size, "ar_decode_s": t["ar_decode_s"] / batch_size,
           "prompt_tokens": t["prompt_tokens"], "generated_tokens": t["generated_tokens"]}
    if store is not None and out.prompt_kv is not None:
        key = kv_key(run_id, shard, out.id)
        t0 = time.perf_counter()
        try:
            row["kv_bytes"] = store.put(key, out.prompt_kv)
            row["kv_key"] = key
        except Exception as e:  # noqa: BLE001 - the DiT step will recompute and say why
            row["kv_error"] = f"{type(e).__name__}: {e}"
        row["kv_put_s"] = time.perf_counter() - t0
    return row


def _error_row(row_id: str, error: str) -> dict[str, Any]:
    return {"id": row_id, "status": "error", "error": error}


def _existing_ids(layout: RunLayout, shard: int) -> set[str]:
    key = layout.ar_key(shard)
    if not layout.store.exists(key):
        return set()
    return set(layout.read_table(key).column("id").to_pylist())


def read_ar_rows(layout: RunLayout, shard: int) -> dict[str, dict[str, Any]]:
    """ar.parquet as {id: row}; empty when the AR step has not run."""
    key = layout.ar_key(shard)
    if not layout.store.exists(key):
        return {}
    return {r["id"]: r for r in layout.read_table(key).to_pylist()}
