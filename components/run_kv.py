"""Where a run's K/V lives: the embedded store beside its outputs (the default), the key of a
row, a `--kv-store` URL opened, and the leftovers of other runs expired."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from components.errors import ConfigError, missing_extra


def default_kv_store(output: str, run_id: str) -> str:
    """The embedded KV store: a directory beside the outputs (or in the temp dir for s3:// outputs,
    in which case AR and DiT must run on the same machine)."""
    if "://" in output and not output.startswith("file://"):
        return "local://" + os.path.join(tempfile.gettempdir(), "ardit-kv", run_id)
    root = output.removeprefix("file://")
    return "local://" + os.path.abspath(os.path.join(root, run_id, "_kv"))


def job_kv_store(output: str, run_id: str, kv_store: str | None) -> str:
    """A local job's K/V store: the one asked for, else the memory of the process that runs a
    shard's AR and DiT steps (every local job runs both in the same model copy's process: the K/V
    never becomes bytes or files). The step programs of a cluster default to default_kv_store."""
    return kv_store or f"memory://{run_id}"


def expire_other_runs_kv(output: str, run_id: str, ttl_s: float) -> int:
    """Expire the K/V older than `ttl_s` in the embedded stores of the other runs beside this one
    (`<output>/<run>/_kv`, or the temp dir's `ardit-kv/<run>` for s3:// outputs): a killed run that
    is never resumed left its payloads there, and no later run opens that directory. Empty store
    directories go too. Payloads counted; best effort (a directory that cannot be read is skipped)."""
    from components.kvstore.local import LocalStore

    root = Path(default_kv_store(output, run_id).removeprefix("local://"))
    if root.name == "_kv":  # <output>/<run>/_kv
        others = [d / "_kv" for d in _subdirs(root.parent.parent)]
    else:  # <tmp>/ardit-kv/<run>
        others = _subdirs(root.parent)
    expired = 0
    for store_dir in others:
        if store_dir == root or not store_dir.is_dir():
            continue
        try:
            expired += LocalStore(store_dir, ttl_s, min_free_bytes=0).expire(ttl_s)
            store_dir.rmdir()  # only ever removes an empty directory
        except OSError:
            pass  # not empty (payloads younger than the TTL), or not ours to touch
    return expired


def _subdirs(path: Path) -> list[Path]:
    try:
        return [d for d in path.iterdir() if d.is_dir()]
    except OSError:
        return []


def kv_key(run_id: str, shard: int, row_id: str) -> str:
    """The row's KV key: any row id works (row_key encodes ids that are not plain)."""
    from components.data.runs import row_key
    from components.kvstore.base import make_key

    return make_key(run_id, shard, row_key(row_id))


def open_kv_store(url: str):
    """open_store, with a missing optional extra or a bad URL as a ConfigError."""
    from components.kvstore.factory import open_store

    try:
        return open_store(url)
    except ImportError as exc:
        raise (missing_extra(exc, f"--kv-store {url}") or exc) from None
    except ValueError as exc:
        raise ConfigError(f"--kv-store: {exc}") from None
