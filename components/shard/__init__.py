"""Shard step: validate a dataset and split it into N deterministic input shards."""

from .run import ShardConflictError, run

__all__ = ["ShardConflictError", "run"]
