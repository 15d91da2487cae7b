"""Summary step: read committed shards and write {output}/{run}/summary.json."""

from .run import run, summarize

__all__ = ["run", "summarize"]
