"""DiT step: one shard's AR outputs -> images, rows.parquet and the commit marker.

    for each row without a committed image:
        kv = kv.get(run/shard/row)          absent? recompute, and record why
        image = engine.dit(...)             denoise + VAE decode
        images/{row}.png, rows/{row}.json   (the image first: a record always has its image)
        kv.delete(run/shard/row)            the payload is consumed
    rows.parquet, then _COMMITTED           (every input row: an image or an error row)
    kv.delete_prefix(run/shard)             no key of this shard survives the commit
"""

from __future__ import annotations

import json
import time
from typing import Any

from components.ar.run import read_ar_rows
from components.data.runs import RunLayout, row_key
from components.engine import AROutput, DiTRequest
from components.steps import default_kv_store, kv_key, load_engine


def run(output: str, run_id: str, shard: int, *, model: str = "tiny", weights: str | None = None,
        kv_store: str | None = None, steps: int = 20, guidance: float = 5.0, flow_shift: float = 3.0,
        seed: int = 0, kv_reuse: bool = True, save_latents: bool = False, device: str = "cpu",
        dtype: str | None = None, progress: Any = None) -> dict[str, Any]:
    from components.kvstore import open_store

    layout = RunLayout.open(output, run_id)
    if layout.is_committed(shard):
        return {"shard": shard, "skipped": "committed"}
    writer = layout.shard_writer(shard)
    pending = writer.pending()
    ar_rows = read_ar_rows(layout, shard)
    engine = load_engine(model, weights, device, dtype)
    store = open_store(kv_store or default_kv_store(output, run_id))
    task = progress.add_task(f"DiT shard {shard}", total=len(pending)) if progress else None
    for job in pending:
        ar_row = ar_rows.get(job.id)
        key = kv_key(run_id, shard, job.id)
        if ar_row is None or ar_row["status"] != "ok":
            error = ar_row["error"] if ar_row else "no AR output for this row (AR step not run or failed)"
            writer.record_error(job.id, error)
            store.delete(key)
        else:
            _denoise_row(engine, store, writer, layout, job, ar_row, key, steps=steps, guidance=guidance, flow_shift=flow_shift, seed=seed,
                         kv_reuse=kv_reuse, save_latents=save_latents, shard=shard)
        if progress:
            progress.advance(task)
    marker = writer.commit()
    store.delete_prefix(f"{run_id}/{shard}")
    store.close()
    return {"shard": shard, **marker}


def _denoise_row(engine, store, writer, layout, job, ar_row, key, *, steps, guidance, flow_shift, seed, kv_reuse,
                 save_latents, shard) -> None:
    ar = AROutput.from_record(json.loads(ar_row["ar_record"]))
    kv, absent_reason, get_s = None, "", None
    if not kv_reuse:
        absent_reason = "reuse disabled"
    elif ar_row.get("kv_error"):
        absent_reason = f"AR could not store KV: {ar_row['kv_error']}"
    elif not ar_row.get("kv_key"):
        absent_reason = "AR exported no KV (no reuse boundary)"
    else:
        t0 = time.perf_counter()
        got = store.get(key, expect_model_id=engine.model_id, expect_config_hash=engine.config_hash,
                        device=str(engine.model.device))
        get_s = time.perf_counter() - t0
        kv, absent_reason = got.kv, ("" if got.ok else f"KV {got.reason}")
    try:
        out = engine.dit(DiTRequest(ar, job.pil_images(), kv, absent_reason, steps=steps, guidance_scale=guidance,
                                    flow_shift=flow_shift, seed=job.effective_seed(seed)))
    except Exception as e:  # noqa: BLE001 - the row ends as an error row, the shard goes on
        writer.record_error(job.id, f"DiT failed: {type(e).__name__}: {e}")
        return
    t = out.timings
    writer.record_ok(
        job.id, out.image, cot_text=ar.cot_text, kv_path=out.kv_path, kv_reason=out.kv_reason or None,
        ar_prefill_s=ar_row["ar_prefill_s"], ar_decode_s=ar_row["ar_decode_s"],
        prompt_tokens=ar_row["prompt_tokens"], generated_tokens=ar_row["generated_tokens"],
        kv_bytes=ar_row.get("kv_bytes"), kv_put_s=ar_row.get("kv_put_s"), kv_get_s=get_s,
        dit_step_s_mean=sum(t["dit_step_s"]) / max(len(t["dit_step_s"]), 1),
        dit_total_s=t["dit_total_s"], vae_decode_s=t["vae_decode_s"],
        dit_prefix_s=t["dit_prefix_s"], generated_ids=json.dumps(ar.generated_ids),
        ratio_index=ar.ratio_index)
    if save_latents:
        import io

        import torch

        buf = io.BytesIO()
        torch.save(out.latents, buf)
        layout.store.put_bytes(f"{layout.shard_prefix(shard)}latents/{row_key(job.id)}.pt", buf.getvalue())
    store.delete(key)  # consumed: the image is committed
