"""Shard step: dataset -> {output}/{run}/inputs/{k}.parquet + inputs/manifest.json.

Rows are validated here; rejected rows travel in the shard files with `error` set, so they end as
error rows of the output instead of vanishing. Shard k holds the contiguous rows
k*n//N .. (k+1)*n//N - 1 in dataset order (see datasets.shard_ranges).

Idempotent: the manifest is written last, and a re-run finding a manifest for the same dataset
bytes, kind, shard count and validation settings does nothing. A manifest for anything else is a
conflict (a run id names one dataset).
"""

from __future__ import annotations

from typing import Any, Callable

from components.data.datasets import (
    DEFAULT_MAX_PROMPT_TOKENS,
    default_is_supported_size,
    ids_digest,
    jobs_to_table,
    read_dataset,
    split_into_shards,
    utf8_bytes,
    validate_dataset,
)
from components.data.runs import RunLayout, utc_now

MANIFEST_VERSION = 1
# What must match for a re-run to be the same sharding.
_IDENTITY = ("dataset", "dataset_fingerprint", "kind", "num_shards", "max_prompt_tokens")


class ShardConflictError(RuntimeError):
    """The run id already holds a manifest for a different dataset or different settings."""


def run(
    dataset: str,
    output: str,
    run_id: str,
    num_shards: int,
    kind: str,
    *,
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS,
    count_tokens: Callable[[str], int] = utf8_bytes,
    is_supported_size: Callable[[int, int], bool] = default_is_supported_size,
) -> dict[str, Any]:
    """Shard `dataset` for `run_id`; returns the manifest (the existing one on a no-op re-run)."""
    if num_shards < 1:
        raise ValueError(f"--num-shards must be >= 1, got {num_shards}")
    layout = RunLayout.open(output, run_id)
    raw = read_dataset(dataset)
    identity = {"dataset": str(dataset), "dataset_fingerprint": raw.fingerprint, "kind": kind,
                "num_shards": num_shards, "max_prompt_tokens": max_prompt_tokens}

    existing = layout.read_json(layout.manifest_key)
    if existing is not None:
        diff = {k: (existing.get(k), identity[k]) for k in _IDENTITY if existing.get(k) != identity[k]}
        if diff:
            details = ", ".join(f"{k}: existing {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
            raise ShardConflictError(f"run {run_id!r} at {layout.store.url(layout.manifest_key)} was sharded "
                                     f"differently ({details}); use a new run id")
        return existing  # same inputs: nothing to do

    valid, errors = validate_dataset(raw, kind, count_tokens=count_tokens, max_prompt_tokens=max_prompt_tokens,
                                     is_supported_size=is_supported_size)
    shards = split_into_shards(valid + errors, num_shards)
    entries = []
    for k, jobs in enumerate(shards):
        layout.write_table(layout.input_key(k), jobs_to_table(jobs))
        entries.append({
            "shard": k,
            "key": layout.input_key(k),
            "rows": len(jobs),
            "errors": sum(not j.ok for j in jobs),
            "first_row": jobs[0].row_index if jobs else None,
            "last_row": jobs[-1].row_index if jobs else None,
            "ids_sha256": ids_digest(j.id for j in jobs),
        })
    manifest = {
        "version": MANIFEST_VERSION,
        "run_id": run_id,
        **identity,
        "dataset_files": raw.files,
        "num_rows": raw.table.num_rows,
        "num_valid": len(valid),
        "num_errors": len(errors),
        "ids_derived": "id" not in raw.table.column_names,
        "shards": entries,
        "created": utc_now(),
    }
    layout.write_json(layout.manifest_key, manifest)  # last: its presence means "inputs complete"
    return manifest
