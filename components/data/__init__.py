"""Data plane: job datasets, object storage, run layout and the shard commit protocol."""

from .datasets import (
    SHARD_SCHEMA,
    DatasetError,
    DatasetSource,
    Job,
    RowValidator,
    iter_jobs,
    parse_size,
    read_dataset,
    shard_ranges,
    validate_dataset,
    validate_rows,
)
from .objectstore import (
    LocalObjectStore,
    ObjectNotFoundError,
    ObjectStore,
    ObjectStoreError,
    S3ObjectStore,
    open_object_store,
)
from .runs import ROWS_SCHEMA, CoverageError, RunLayout, ShardNotReadyError, ShardWriter, check_coverage, row_key

__all__ = [
    "SHARD_SCHEMA", "DatasetError", "DatasetSource", "Job", "RowValidator", "iter_jobs", "parse_size",
    "read_dataset", "shard_ranges", "validate_dataset", "validate_rows",
    "LocalObjectStore", "ObjectNotFoundError", "ObjectStore", "ObjectStoreError", "S3ObjectStore",
    "open_object_store",
    "ROWS_SCHEMA", "CoverageError", "RunLayout", "ShardNotReadyError", "ShardWriter", "check_coverage", "row_key",
]
