"""Reading a finished run: `{output}/{run}/shards/{k}/rows.parquet`, images and optional latents.

Only what evaluation needs; the run layout itself is described in docs/architecture.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from PIL import Image

OK_STATUSES = frozenset({"ok", "success", "succeeded", "done", "completed"})
# Per-row stage timings (seconds) a run may record; the sum is the time per image.
STAGE_TIMINGS: tuple[str, ...] = ("ar_prefill_s", "ar_decode_s", "dit_total_s", "vae_decode_s")
TOTAL_TIMINGS: tuple[str, ...] = ("total_s", "e2e_s")


def local_path(uri: str | Path) -> Path:
    """A local path for a run URI (plain path or file://). Remote stores are not read here."""
    text = str(uri)
    if text.startswith("file://"):
        return Path(text[len("file://") :])
    if "://" in text:
        raise ValueError(f"{text}: not a local path (remote runs are fetched with fetch_run)")
    return Path(text)


def run_dir(output: str | Path, run_id: str) -> Path:
    return local_path(output) / run_id


def is_remote(uri: str | Path) -> bool:
    text = str(uri)
    return "://" in text and not text.startswith("file://")


# Objects of a run that evaluation reads (AR records, per-row JSON and inputs are not needed).
_FETCH_SUFFIXES = ("/rows.parquet", ".png", ".pt")


def fetch_run(output: str, run_id: str, cache: Path) -> Path:
    """Copy a run's rows.parquet, images and latents from an object store (s3://...) into `cache`,
    keeping the keys, so `{cache}/{run_id}` is an ordinary local run directory."""
    from components.data.objectstore import open_object_store

    store = open_object_store(output)
    keys = [k for k in store.list(f"{run_id}/shards/") if k.endswith(_FETCH_SUFFIXES)]
    if not keys:
        raise FileNotFoundError(f"no shards under {store.url(run_id)}")
    for key in keys:
        dest = cache.joinpath(*key.split("/"))
        dest.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(key, dest)
    return cache / run_id


@dataclass
class RunRow:
    id: str
    shard: str
    status: str
    error: str
    image_path: Path | None
    cot_text: str | None
    generated_ids: list[int] | None
    width: int | None
    height: int | None
    kv_path: str | None
    kv_reason: str | None
    timings: dict[str, float] = field(default_factory=dict)
    latents_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.status or "").lower() in OK_STATUSES and not self.error

    def time_per_image_s(self) -> float | None:
        for key in TOTAL_TIMINGS:
            if key in self.timings:
                return self.timings[key]
        parts = [self.timings[k] for k in STAGE_TIMINGS if k in self.timings]
        return float(sum(parts)) if parts else None

    def timing_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: self.timings.get(k) for k in STAGE_TIMINGS}
        out["time_per_image_s"] = self.time_per_image_s()
        out["generated_tokens"] = self.extra.get("generated_tokens")
        out["kv_path"] = self.kv_path
        out["kv_reason"] = self.kv_reason
        return out


def _num(v: Any) -> float | None:
    """A finite-or-inf float, or None for missing / NaN / non-numbers (bools are not numbers here)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def storage_name(row_id: str) -> str:
    """The file name stem of a row's objects (images/{name}.png, latents/{name}.pt)."""
    try:
        from components.data.runs import row_key
    except ImportError:  # pragma: no cover - the data package ships with the steps
        return row_id
    return row_key(row_id)


def _token_ids(value: Any) -> list[int] | None:
    """generated_ids as a list: stored as list<int> or as a JSON array string."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else []
    return [int(t) for t in value]


def _resolve_image(run: Path, shard_dir: Path, row: dict[str, Any]) -> Path | None:
    """The image of a row: its image_key (relative to the run, the output root, or absolute),
    falling back to the layout's `shards/{k}/images/{id}.png`."""
    key = row.get("image_key")
    candidates: list[Path] = []
    if key:
        key_path = Path(str(key).replace("file://", "", 1))
        if key_path.is_absolute():
            candidates.append(key_path)
        candidates += [run / key_path, run.parent / key_path, shard_dir / key_path]
    candidates.append(shard_dir / "images" / f"{storage_name(str(row['id']))}.png")
    for c in candidates:
        if c.is_file():
            return c
    return candidates[0] if candidates else None


def _shard_dirs(run: Path) -> list[Path]:
    shards = run / "shards"
    if not shards.is_dir():
        return []

    def order(p: Path) -> tuple[int, str]:
        return (int(p.name), p.name) if p.name.isdigit() else (1 << 30, p.name)

    return sorted((p for p in shards.iterdir() if p.is_dir()), key=order)


def load_run_rows(run_uri: str | Path) -> dict[str, RunRow]:
    """All rows of a run by id (dataset order when row_index is recorded, else shard order). Raises FileNotFoundError when the run has no rows."""
    run = local_path(run_uri)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory not found: {run}")
    rows: dict[str, RunRow] = {}
    found = False
    for shard_dir in _shard_dirs(run):
        table_path = shard_dir / "rows.parquet"
        if not table_path.is_file():
            continue
        found = True
        for rec in pq.read_table(table_path).to_pylist():
            row_id = str(rec["id"])
            timings = {k: f for k in rec if k.endswith("_s") and (f := _num(rec[k])) is not None}
            ids = _token_ids(rec.get("generated_ids"))
            latents = shard_dir / "latents" / f"{storage_name(row_id)}.pt"
            rows[row_id] = RunRow(
                id=row_id,
                shard=shard_dir.name,
                status=str(rec.get("status") or ""),
                error=str(rec.get("error") or ""),
                image_path=_resolve_image(run, shard_dir, rec),
                cot_text=rec.get("cot_text"),
                generated_ids=ids,
                width=rec.get("width"),
                height=rec.get("height"),
                kv_path=rec.get("kv_path"),
                kv_reason=rec.get("kv_reason"),
                timings=timings,
                latents_path=latents if latents.is_file() else None,
                extra={
                    "generated_tokens": rec.get("generated_tokens"),
                    "prompt": rec.get("prompt"),
                    "row_index": rec.get("row_index"),
                },
            )
    if not found:
        raise FileNotFoundError(f"no shards/*/rows.parquet under {run}")
    if rows and all(r.extra["row_index"] is not None for r in rows.values()):
        rows = dict(sorted(rows.items(), key=lambda kv: int(kv[1].extra["row_index"])))  # dataset order
    return rows


def read_image(row: RunRow) -> Image.Image | None:
    if row.image_path is None or not row.image_path.is_file():
        return None
    with Image.open(row.image_path) as im:
        im.load()
        return im.copy()


def load_latents(row: RunRow) -> Any | None:
    if row.latents_path is None:
        return None
    import torch

    return torch.load(row.latents_path, map_location="cpu", weights_only=True)


def load_run_inputs(run_uri: str | Path) -> dict[str, Any]:
    """What each row asked for, by id: the shard step's inputs/{k}.parquet as components.data Jobs
    (text = the instruction or prompt, image = the input image's bytes). {} when the run has none."""
    from components.data.datasets import jobs_from_table

    run = local_path(run_uri)
    jobs: dict[str, Any] = {}
    for path in sorted((run / "inputs").glob("*.parquet"), key=lambda p: (len(p.stem), p.stem)):
        for job in jobs_from_table(pq.read_table(path)):
            jobs[job.id] = job
    return jobs
