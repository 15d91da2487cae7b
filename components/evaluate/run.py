"""Evaluation step: metrics of `{output}/{run}` against `{output}/{ref_run}`.

Writes, next to the run:
- `{output}/{run}/metrics.parquet`: one row per row id (eval_status, PSNR, SSIM, |Δ| stats, ...);
- `{output}/{run}/metrics_config.parquet`: one row for the whole config (aggregates, pass/fail).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components.evaluate.gates import Thresholds, records_to_table, summarize
from components.evaluate.metrics import compare_runs
from components.evaluate.runio import run_dir

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
    """Compare `run` with `ref_run` under `output`; returns (row records, config summary)."""
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
        pq.write_table(records_to_table(rows), other_dir / METRICS_FILE)
        pq.write_table(pa.Table.from_pylist([summary]), other_dir / CONFIG_METRICS_FILE)
    return rows, summary
