"""Evaluation step: metrics of `{output}/{run}` against `{output}/{ref_run}`.

Writes, next to the run:
- `{output}/{run}/metrics.parquet`: one row per row id (eval_status, PSNR, SSIM, |Δ| stats, ...);
- `{output}/{run}/metrics_config.parquet`: one row for the whole config (aggregates, pass/fail).
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components.evaluate.gates import Thresholds, records_to_table, summarize
from components.evaluate.metrics import compare_runs
from components.evaluate.runio import fetch_run, is_remote, local_path, run_dir

METRICS_FILE = "metrics.parquet"
CONFIG_METRICS_FILE = "metrics_config.parquet"


def evaluate_run(
    output: str | Path,
    ref_run: str,
    run: str,
    thresholds: Thresholds | None = None,
    *,
    write: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Compare `run` with `ref_run` under `output` (a local directory or an object-store URI such
    as s3://bucket/prefix); returns (row records, config summary)."""
    if is_remote(output):
        with tempfile.TemporaryDirectory(prefix="ardit-eval-") as tmp:
            ref_dir, other_dir = fetch_run(str(output), ref_run, Path(tmp)), fetch_run(str(output), run, Path(tmp))
            rows = compare_runs(ref_dir, other_dir)
    else:
        ref_dir, other_dir = run_dir(output, ref_run), run_dir(output, run)
        rows = compare_runs(ref_dir, other_dir)
    for r in rows:
        r["run"] = run
        r["ref_run"] = ref_run
    summary: dict[str, Any] = {"run": run, "ref_run": ref_run}
    summary.update(summarize(rows, thresholds))
    if thresholds is not None:
        summary["thresholds"] = json.dumps(thresholds.as_dict())
    if write:
        _write_table(output, f"{run}/{METRICS_FILE}", records_to_table(rows))
        _write_table(output, f"{run}/{CONFIG_METRICS_FILE}", pa.Table.from_pylist([summary]))
    return rows, summary


def _write_table(output: str | Path, key: str, table: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    if is_remote(output):
        from components.data.objectstore import open_object_store

        open_object_store(str(output)).put_bytes(key, buf.getvalue())
    else:
        (local_path(output) / key).write_bytes(buf.getvalue())
