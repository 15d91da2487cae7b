"""Summary step: manifest + every committed shard's rows.parquet -> {output}/{run}/summary.json.

Shard status: "committed" (marker matches rows.parquet), "corrupt" (marker present, rows.parquet
missing or with another checksum), "uncommitted" (some output exists, no marker: interrupted or
still running), "missing" (nothing written). Only committed shards are counted in the row totals;
the rows of the others are reported as `rows_pending`.

Throughput: `images_per_minute` = ok images / wall time, where wall time runs from the manifest's
creation (shard step) to the last commit. Time split (seconds): load = the engine loads of the
AR and DiT steps (each step records its own, 0 when its process had the engine loaded already);
sums of the per-row columns: ar = ar_prefill_s + ar_decode_s, kv = kv_put_s + kv_get_s,
dit = dit_total_s + vae_decode_s; other = wall time minus those (sharding, image preparation, PNG
and Parquet writes, commits), null when the parts exceed the wall time (shards run in parallel, or
a shard's AR and DiT ran at once: `shards_overlapped`; their load is in the shard's "overlap" step
record). `kv_stores` counts how the reused K/V came (memory: handed over inside the model copy).
Per shard, `time_s` holds its load, ar, kv and dit. A local job of several data-parallel replicas
(split_by_replica) adds `time_split_by_replica_s`, each replica's split adding up to wall_s, and
its `time_split_s` is in replica-seconds: the replicas' splits summed, adding up to replicas x wall_s.

KV wait: per shard, `kv_wait_s` is the time the DiT loop waited for KV payloads (what the
prefetch did not hide) and `kv_wait_fraction` that time over the shard's DiT time (target < 2 %).
`kv_reasons` counts why rows recomputed (reuse rows have no reason and are not in it).
`kernel_fallbacks` sums the rows' count of fast kernel paths that failed on a shape and fell back
to the plain path (a slower row, not a failed one; the first error is in the step's log).
Per shard, `steps` holds what each step recorded beyond its rows (`shards/<k>/steps/<step>.json`):
its wall time, the AR scheduler's batch, phases, graph captures and recovered OOMs, GPU memory
(peaks, allocator retries: engine/step_memory.py) and what it compiled (frames, seconds).
`ar_oom_retries` and `gpu_alloc_retries` sum them: a job that ran at the edge of GPU memory failed
no row for it, but ran slower.
Floats are rounded to 4 significant digits.
"""

from __future__ import annotations

import math
from collections import Counter
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from components.data.runs import RunLayout, utc_now

TIME_GROUPS = {
    "ar": ("ar_prefill_s", "ar_decode_s"),
    "kv": ("kv_put_s", "kv_get_s"),
    "dit": ("dit_total_s", "vae_decode_s"),
}
MEAN_COLUMNS = ("prompt_tokens", "generated_tokens", "ar_prefill_s", "ar_decode_s", "kv_bytes", "kv_put_s",
                "kv_get_s", "dit_step_s_mean", "dit_total_s", "vae_decode_s")
MAX_ERRORS_LISTED = 100


def _sum(table: pa.Table, column: str) -> float:
    if column not in table.column_names or table.num_rows == 0:
        return 0.0
    value = pc.sum(table.column(column)).as_py()
    return float(value or 0.0)


def _mean(table: pa.Table, column: str) -> float | None:
    if column not in table.column_names or table.num_rows == 0:
        return None
    value = pc.mean(table.column(column)).as_py()  # nulls skipped
    return None if value is None else float(value)


def _shard_status(layout: RunLayout, k: int) -> str:
    marker = layout.commit_marker(k)
    if marker is not None:
        return "committed" if layout.is_committed(k) else "corrupt"
    return "uncommitted" if layout.store.list(layout.shard_prefix(k)) else "missing"


def summarize(layout: RunLayout) -> dict[str, Any]:
    """Compute the summary dict of a run (does not write it)."""
    manifest = layout.manifest()
    shards: list[dict[str, Any]] = []
    tables: list[pa.Table] = []
    pending = 0
    load_s = 0.0
    for entry in manifest["shards"]:
        k = entry["shard"]
        status = _shard_status(layout, k)
        info: dict[str, Any] = {"shard": k, "status": status, "rows": entry["rows"]}
        if status == "committed":
            table = layout.read_rows(k)
            marker = layout.commit_marker(k) or {}
            ok = int(pc.sum(pc.equal(table.column("status"), "ok")).as_py() or 0)
            dit_s = _sum(table, "dit_total_s") + _sum(table, "vae_decode_s")
            wait_s = _sum(table, "kv_wait_s")
            info.update(ok=ok, failed=table.num_rows - ok, started_at=marker.get("started_at"),
                        committed_at=marker.get("committed_at"), dit_s=dit_s, kv_wait_s=wait_s,
                        kv_wait_fraction=(wait_s / dit_s) if dit_s else None,
                        kernel_fallbacks=int(_sum(table, "kernel_fallbacks")))
            tables.append(table.append_column("shard", pa.array([k] * table.num_rows, pa.int64())))
            # "overlap": the AR and DiT ran at once on one engine (components/overlap/run.py), which
            # it loaded for both: its record holds that load
            records = {step: layout.read_json(layout.step_timing_key(k, step)) or {}
                       for step in ("ar", "dit", "overlap")}
            shard_load_s = sum(r.get("load_s", 0.0) for r in records.values())
            load_s += shard_load_s
            info["time_s"] = {"load": shard_load_s, **{g: sum(_sum(table, c) for c in cols)
                                                       for g, cols in TIME_GROUPS.items()}}
            info.update(steps={step: {key: r[key] for key in ("wall_s", "scheduler", "memory", "compile", "handoff")
                                      if key in r}
                               for step, r in records.items() if r})
            if records["overlap"]:
                info["overlapped"] = True
        else:
            pending += entry["rows"]
        shards.append(info)

    rows = pa.concat_tables(tables, promote_options="permissive") if tables else None
    ok_rows = rows.filter(pc.equal(rows.column("status"), "ok")) if rows is not None else None
    n_ok = ok_rows.num_rows if ok_rows is not None else 0
    n_failed = (rows.num_rows - n_ok) if rows is not None else 0

    commits = [s["committed_at"] for s in shards if s.get("committed_at")]
    wall_s = None
    if commits:
        wall_s = max(0.0, (max(map(datetime.fromisoformat, commits))
                           - datetime.fromisoformat(manifest["created"])).total_seconds())

    time_split = _with_other({"load": load_s, **{g: sum(_sum(rows, c) for c in cols) if rows is not None else 0.0
                                                 for g, cols in TIME_GROUPS.items()}}, wall_s)
    errors = []
    if rows is not None:
        failed = rows.filter(pc.not_equal(rows.column("status"), "ok")).select(["shard", "id", "error"])
        errors = failed.slice(0, MAX_ERRORS_LISTED).to_pylist()

    summary = {
        "run_id": layout.run_id,
        "dataset": manifest.get("dataset"),
        "kind": manifest.get("kind"),
        "num_shards": manifest["num_shards"],
        "rows_total": manifest["num_rows"],
        "rows_ok": n_ok,
        "rows_failed": n_failed,
        "rows_pending": pending,
        "complete": all(s["status"] == "committed" for s in shards),
        "shards_committed": [s["shard"] for s in shards if s["status"] == "committed"],
        "shards_missing": [s["shard"] for s in shards if s["status"] == "missing"],
        "shards_uncommitted": [s["shard"] for s in shards if s["status"] in ("uncommitted", "corrupt")],
        "shards": shards,
        "wall_s": wall_s,
        "images_per_minute": (n_ok / wall_s * 60.0) if wall_s else None,
        "time_split_s": time_split,
        "time_split_fraction": _fractions(time_split),
        "kv_paths": dict(Counter(ok_rows.column("kv_path").to_pylist())) if ok_rows is not None else {},
        # how the reused K/V came: memory (handed over inside the model copy), local, mooncake
        "kv_stores": (dict(Counter(r for r in ok_rows.column("kv_store").to_pylist() if r is not None))
                      if ok_rows is not None and "kv_store" in ok_rows.column_names else {}),
        # shards whose AR and DiT ran at once: their AR and DiT seconds overlap in time_split_s
        "shards_overlapped": sum(bool(s.get("overlapped")) for s in shards),
        "kv_reasons": (dict(Counter(r for r in ok_rows.column("kv_reason").to_pylist() if r is not None))
                       if ok_rows is not None else {}),
        "kv_wait_fraction": _kv_wait_fraction(shards),
        "kernel_fallbacks": sum(s.get("kernel_fallbacks", 0) for s in shards),
        # running at the edge of GPU memory fails no row but costs time (engine/step_memory.py)
        "ar_oom_retries": sum(step_record(s, "ar", "scheduler").get("oom_retries") or 0 for s in shards),
        "gpu_alloc_retries": sum(step_record(s, step, "memory").get("alloc_retries") or 0 for s in shards
                                 for step in ("ar", "dit")),
        "means_ok_rows": {c: _mean(ok_rows, c) for c in MEAN_COLUMNS} if ok_rows is not None else {},
        "errors": errors,
        "errors_truncated": max(0, n_failed - len(errors)),
        "created": utc_now(),
    }
    # JSON keys must be strings: a null kv_path (not recorded) is listed as "unknown"
    summary["kv_paths"] = {("unknown" if k is None else str(k)): v for k, v in summary["kv_paths"].items()}
    return _rounded(summary)


def _with_other(parts: dict[str, float], wall_s: float | None) -> dict[str, float | None]:
    """`parts` and `other`: the wall time they leave (None when they exceed it or no wall time)."""
    other = wall_s - sum(parts.values()) if wall_s is not None else None
    return {**parts, "other": other if other is not None and other >= 0 else None}


def _fractions(split: dict[str, float | None]) -> dict[str, float | None]:
    total = sum(v for v in split.values() if v is not None)
    return {g: (v / total if total and v is not None else None) for g, v in split.items()}


def split_by_replica(summary: dict[str, Any], ran: dict[int, int], replicas: int) -> None:
    """A local job's data-parallel replicas in its summary: `replica` per shard (`ran`: shard ->
    replica) and, with several replicas, `time_split_by_replica_s`: each replica's time split over
    the shards it ran, adding up to wall_s (its `other`: sharding, writes, commits, waiting). Their
    steps overlap, so `time_split_s` becomes replica-seconds: the sum of the replicas', adding up to
    replicas x wall_s."""
    for entry in summary["shards"]:
        if entry["shard"] in ran:
            entry["replica"] = ran[entry["shard"]]
    if replicas <= 1:
        return
    wall_s = summary.get("wall_s")
    groups = ("load", *TIME_GROUPS)
    by_replica = {}
    for replica in range(replicas):
        times = [e.get("time_s") or {} for e in summary["shards"] if e.get("replica") == replica]
        by_replica[str(replica)] = _with_other({g: sum(t.get(g, 0.0) for t in times) for g in groups}, wall_s)
    total = {g: summary["time_split_s"][g] for g in groups}
    total = _with_other(total, wall_s * replicas if wall_s is not None else None)
    summary.update(time_split_by_replica_s=_rounded(by_replica), time_split_s=_rounded(total),
                   time_split_fraction=_rounded(_fractions(total)))


def step_record(shard: dict[str, Any], step: str, part: str) -> dict[str, Any]:
    """A part ("scheduler", "memory") of what a shard's step ("ar", "dit") recorded, {} when none."""
    return (shard.get("steps", {}).get(step) or {}).get(part) or {}


def _kv_wait_fraction(shards: list[dict[str, Any]]) -> float | None:
    dit = sum(s.get("dit_s") or 0.0 for s in shards)
    return sum(s.get("kv_wait_s") or 0.0 for s in shards) / dit if dit else None


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits, all the way down."""
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def run(output: str, run_id: str) -> dict[str, Any]:
    """Summarize the run and write summary.json; returns the summary dict."""
    layout = RunLayout.open(output, run_id)
    summary = summarize(layout)
    layout.write_json(layout.summary_key, summary)
    return summary
