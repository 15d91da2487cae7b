"""Shard step: dataset -> {output}/{run}/inputs/{k}.parquet + inputs/manifest.json.

Rows are validated here; rejected rows travel in the shard files with `error` set, so they end as
error rows of the output instead of vanishing. Shard k holds the contiguous rows
k*n//N .. (k+1)*n//N - 1 in dataset order (see datasets.shard_ranges).

Idempotent: the manifest is written last, and a re-run finding a manifest for the same dataset
bytes, kind, shard count and validation settings does nothing. A manifest for anything else is a
conflict (a run id names one dataset).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any, Callable, Iterator

import pyarrow.parquet as pq

from components.data.datasets import (
    DEFAULT_MAX_PROMPT_TOKENS,
    SHARD_SCHEMA,
    DatasetError,
    IdsDigest,
    Job,
    default_is_supported_size,
    iter_jobs,
    jobs_to_table,
    read_dataset,
    shard_ranges,
    utf8_bytes,
)
from components.data.runs import RunLayout, utc_now
from components.errors import ConfigError

MANIFEST_VERSION = 1
# What must match for a re-run to be the same sharding.
_IDENTITY = ("dataset", "dataset_fingerprint", "kind", "num_shards", "max_prompt_tokens")
WRITE_BATCH = 256  # rows per Parquet row group in shard files


class ShardConflictError(ConfigError):
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
        raise ConfigError(f"--num-shards {num_shards}: must be a whole number >= 1")
    layout = RunLayout.open(output, run_id)
    source = read_dataset(dataset)  # footers only; rows are streamed below
    identity = shard_identity(dataset, source.fingerprint, kind, num_shards, max_prompt_tokens)

    existing = check_existing(layout, identity)
    if existing is not None:
        return existing  # same inputs: nothing to do

    jobs = iter_jobs(source, kind, count_tokens=count_tokens, max_prompt_tokens=max_prompt_tokens,
                     is_supported_size=is_supported_size)
    # Shards are contiguous ranges, so they are written one after the other while streaming.
    entries = [_write_shard(layout, k, itertools.islice(jobs, stop - start))
               for k, (start, stop) in enumerate(shard_ranges(source.num_rows, num_shards))]
    if sum(e["rows"] for e in entries) != source.num_rows or next(jobs, None) is not None:
        raise DatasetError(f"dataset {dataset} changed while being sharded; no manifest written, re-run")
    manifest = {
        "version": MANIFEST_VERSION,
        "run_id": run_id,
        **identity,
        "dataset_files": source.files,
        "num_rows": source.num_rows,
        "num_valid": sum(e["rows"] - e["errors"] for e in entries),
        "num_errors": sum(e["errors"] for e in entries),
        "ids_derived": not source.has_ids,
        "shards": entries,
        "created": utc_now(),
    }
    layout.write_json(layout.manifest_key, manifest)  # last: its presence means "inputs complete"
    return manifest


def shard_identity(dataset: str, fingerprint: str, kind: str, num_shards: int,
                   max_prompt_tokens: int | None) -> dict[str, Any]:
    """What must match for a re-run to be the same sharding."""
    return {"dataset": str(dataset), "dataset_fingerprint": fingerprint, "kind": kind, "num_shards": num_shards,
            "max_prompt_tokens": max_prompt_tokens}


def check_existing(layout: RunLayout, identity: dict[str, Any], existing: Any = ...) -> dict[str, Any] | None:
    """The run's manifest if it has one for this identity; None if it has none; a
    ShardConflictError if the run id already belongs to another dataset or sharding.
    `existing`: the manifest, when the caller read it already (a RunState's); else it is read here."""
    if existing is ...:
        existing = layout.read_json(layout.manifest_key)
    if existing is None:
        return None
    diff = {k: (existing.get(k), identity[k]) for k in _IDENTITY if existing.get(k) != identity[k]}
    if diff:
        details = ", ".join(f"{k}: existing {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
        raise ShardConflictError(f"run {layout.run_id!r} at {layout.store.url(layout.manifest_key)} was sharded "
                                 f"differently ({details}); use a new run id (or drop --run-id)")
    return existing


def _write_shard(layout: RunLayout, k: int, jobs: Iterator[Job]) -> dict[str, Any]:
    """Stream one shard's jobs into a local Parquet file, then upload it (atomically) in one go."""
    rows = errors = 0
    first = last = None
    ids = IdsDigest()
    fd, tmp = tempfile.mkstemp(suffix=".parquet")
    os.close(fd)
    try:
        with pq.ParquetWriter(tmp, SHARD_SCHEMA) as writer:
            while batch := list(itertools.islice(jobs, WRITE_BATCH)):
                writer.write_table(jobs_to_table(batch))
                for job in batch:
                    ids.update(job.id)
                    errors += not job.ok
                first = batch[0].row_index if first is None else first
                last = batch[-1].row_index
                rows += len(batch)
        layout.store.put_file(layout.input_key(k), tmp)
    finally:
        os.unlink(tmp)
    return {"shard": k, "key": layout.input_key(k), "rows": rows, "errors": errors,
            "first_row": first, "last_row": last, "ids_sha256": ids.hexdigest()}
