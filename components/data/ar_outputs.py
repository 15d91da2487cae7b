"""ar.parquet: what the AR step hands the DiT step for each row of a shard (read by both)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from .runs import RunLayout

AR_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("status", pa.string()),  # ok | error
    ("error", pa.string()),
    ("error_kind", pa.string()),  # input (a bad row: final) | transient (out of memory, ...: a resume retries it)
    ("ar_record", pa.string()),  # AROutput.to_record() as JSON
    ("kv_key", pa.string()),
    ("kv_bytes", pa.int64()),
    ("kv_put_s", pa.float64()),
    ("kv_error", pa.string()),
    ("ar_prefill_s", pa.float64()),
    ("ar_decode_s", pa.float64()),
    ("prompt_tokens", pa.int64()),
    ("generated_tokens", pa.int64()),
    ("kernel_fallbacks", pa.int64()),  # fast paths that fell back to plain ones in this row's batch
])


def write_ar_rows(layout: RunLayout, shard: int, rows: list[dict[str, Any]]) -> None:
    """ar.parquet, written once and atomically at the end of the AR step."""
    layout.write_table(layout.ar_key(shard), pa.Table.from_pylist(rows, schema=AR_SCHEMA))


def read_ar_rows(layout: RunLayout, shard: int) -> dict[str, dict[str, Any]]:
    """ar.parquet as {id: row}; empty when the AR step has not run."""
    key = layout.ar_key(shard)
    if not layout.store.exists(key):
        return {}
    return {r["id"]: r for r in layout.read_table(key).to_pylist()}
