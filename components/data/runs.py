"""The run layout in object storage, and the commit / resume protocol of a shard.

    {output}/{run}/inputs/manifest.json, inputs/{k}.parquet     shard step
    {output}/{run}/shards/{k}/ar.parquet                         AR step
    {output}/{run}/shards/{k}/images/{row}.png                   DiT step, one object per row
    {output}/{run}/shards/{k}/rows/{row}.json                    DiT step, one per finished row
    {output}/{run}/shards/{k}/rows.parquet                       assembled at commit
    {output}/{run}/shards/{k}/_COMMITTED                         written LAST
    {output}/{run}/settings/{ar,dit}.json                        what each step computes with
    {output}/{run}/summary.json                                  summary step

Why it is safe to kill a step at any moment: every object write is atomic (local temp file +
rename; S3 PUT / completed multipart upload), a row's JSON record is written only after its PNG,
and the marker only after rows.parquet. So a row counts as done iff its record exists, and a
shard counts as done iff its marker exists and matches rows.parquet. A re-run skips done rows.

    layout = RunLayout.open("s3://bucket/out", "run1")
    writer = layout.shard_writer(3)
    for job in writer.pending():                    # valid rows not yet done (resume)
        writer.record_ok(job.id, pil_image, cot_text=..., kv_path="reuse", dit_total_s=1.2)
    writer.commit()                                 # rows.parquet, then _COMMITTED
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

import pyarrow as pa

from components.errors import ConfigError

from .datasets import Job, jobs_from_table, read_parquet_bytes, write_parquet_bytes
from .objectstore import ObjectNotFoundError, ObjectStore, open_object_store

# rows.parquet: these columns always exist (null where unknown), in this order; extra metric
# columns a step records are appended after them. Times are seconds for this row; when work is
# batched (AR over a shard) a step records the row's share. dit_total_s excludes vae_decode_s.
ROWS_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("row_index", pa.int64()),
        ("status", pa.string()),  # "ok" | "error"
        ("error", pa.string()),
        ("image_key", pa.string()),  # key under the output root: {run}/shards/{k}/images/{row}.png
        ("cot_text", pa.string()),
        ("width", pa.int64()),
        ("height", pa.int64()),
        ("kv_path", pa.string()),  # "reuse" | "recompute"
        ("kv_reason", pa.string()),
        ("ar_prefill_s", pa.float64()),
        ("ar_decode_s", pa.float64()),
        ("prompt_tokens", pa.int64()),
        ("generated_tokens", pa.int64()),
        ("kv_bytes", pa.int64()),
        ("kv_put_s", pa.float64()),
        ("kv_get_s", pa.float64()),
        ("kv_wait_s", pa.float64()),  # of kv_get_s, what the DiT loop waited for (prefetch hides the rest)
        ("dit_step_s_mean", pa.float64()),
        ("dit_total_s", pa.float64()),
        ("vae_decode_s", pa.float64()),
    ]
)
CORE_COLUMNS = frozenset(ROWS_SCHEMA.names)
MARKER_NAME = "_COMMITTED"
_STEP_NAMES = {"ar": "AR", "dit": "DiT"}


class InvalidRunIdError(ConfigError, ValueError):
    """A run id that cannot name a directory / key prefix."""


class SettingsConflictError(ConfigError):
    """The run was started with other settings; resuming it now would mix them."""

    def __init__(self, message: str, differences: dict[str, tuple[Any, Any]]):
        super().__init__(message)
        self.differences = differences


class CoverageError(RuntimeError):
    """Input rows and output rows do not match one to one."""


class ShardNotReadyError(RuntimeError):
    """The shard cannot be committed yet: some valid rows have no result."""


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def row_key(row_id: str) -> str:
    """A storage-safe name for a row id: the id itself when it is plain, else a cleaned prefix
    plus '~' and a hash ('~' never occurs in plain ids, so two ids never share a name)."""
    if _SAFE_ID.fullmatch(row_id) and not row_id.endswith(".tmp"):
        return row_id
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", row_id)[:64].strip("._") or "id"
    return f"{cleaned}~{hashlib.sha256(row_id.encode()).hexdigest()[:16]}"


def _scalar(value: Any) -> Any:
    """numpy / torch scalars (e.g. a float32 timing) become plain numbers; anything else that
    JSON cannot hold is an error naming its type."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    raise TypeError(f"row metric of type {type(value).__name__} cannot be stored (use numbers or strings)")


def check_coverage(inputs: Sequence[Job], outputs: Sequence[dict[str, Any]]) -> None:
    """Raise CoverageError unless every input row has exactly one output row (by position and id)."""
    expected = {j.row_index: j.id for j in inputs}
    seen: dict[int, int] = {}
    problems: list[str] = []
    for out in outputs:
        idx = out.get("row_index")
        if idx not in expected:
            problems.append(f"output row {out.get('id')!r} (row {idx}) is not an input row")
            continue
        if out.get("id") != expected[idx]:
            problems.append(f"row {idx}: output id {out.get('id')!r} != input id {expected[idx]!r}")
        seen[idx] = seen.get(idx, 0) + 1
    problems += [f"row {i} ({expected[i]!r}) has {n} output rows" for i, n in sorted(seen.items()) if n > 1]
    problems += [f"row {i} ({expected[i]!r}) has no output row" for i in sorted(expected) if i not in seen]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CoverageError(f"{len(problems)} coverage problem(s): {shown}")


def rows_table(records: Sequence[dict[str, Any]]) -> pa.Table:
    """rows.parquet contents: the core columns (typed, null-filled) plus any extra columns."""
    extras = sorted({k for r in records for k in r} - CORE_COLUMNS)
    core = pa.Table.from_pylist([{k: r.get(k) for k in ROWS_SCHEMA.names} for r in records], schema=ROWS_SCHEMA)
    if not extras:
        return core
    extra = pa.Table.from_pylist([{k: r.get(k) for k in extras} for r in records])
    for name in extras:
        core = core.append_column(name, extra.column(name))
    return core


@dataclass(frozen=True)
class RunState:
    """A run's state as one read found it (RunLayout.state): no manifest means nothing was sharded."""

    manifest: dict[str, Any] | None
    settings: dict[str, dict[str, Any] | None]  # step -> its recorded settings (None: none yet)
    committed: frozenset[int]

    @property
    def finished(self) -> bool:
        return self.manifest is not None and len(self.committed) == self.manifest["num_shards"]

    def todo(self, num_shards: int) -> list[int]:
        """The shards of a `num_shards` sharding a job still has to run (a resume: the uncommitted)."""
        return [k for k in range(num_shards) if k not in self.committed]


@dataclass
class RunLayout:
    """Keys of one run inside an output store (keys are relative to the output root)."""

    store: ObjectStore
    run_id: str

    def __post_init__(self) -> None:
        if not _SAFE_ID.fullmatch(self.run_id) or self.run_id.endswith(".tmp"):
            raise InvalidRunIdError(f"--run-id {self.run_id!r}: use 1-128 letters, digits, '.', '_' or '-', "
                                    "starting with a letter or digit (it names a directory)")

    @classmethod
    def open(cls, output_uri: str, run_id: str) -> RunLayout:
        return cls(open_object_store(output_uri), run_id)

    # --- keys
    @property
    def manifest_key(self) -> str:
        return f"{self.run_id}/inputs/manifest.json"

    def input_key(self, shard: int) -> str:
        return f"{self.run_id}/inputs/{shard}.parquet"

    def shard_prefix(self, shard: int) -> str:
        return f"{self.run_id}/shards/{shard}/"

    def ar_key(self, shard: int) -> str:
        return f"{self.shard_prefix(shard)}ar.parquet"

    def image_key(self, shard: int, row_id: str) -> str:
        return f"{self.shard_prefix(shard)}images/{row_key(row_id)}.png"

    def row_record_key(self, shard: int, row_id: str) -> str:
        return f"{self.shard_prefix(shard)}rows/{row_key(row_id)}.json"

    def rows_key(self, shard: int) -> str:
        return f"{self.shard_prefix(shard)}rows.parquet"

    def step_timing_key(self, shard: int, step: str) -> str:
        """What the shard's AR or DiT step measured outside the rows (its engine load)."""
        return f"{self.shard_prefix(shard)}steps/{step}.json"

    def marker_key(self, shard: int) -> str:
        return f"{self.shard_prefix(shard)}{MARKER_NAME}"

    @property
    def summary_key(self) -> str:
        return f"{self.run_id}/summary.json"

    def settings_key(self, step: str) -> str:
        return f"{self.run_id}/settings/{step}.json"

    # --- settings: a run computes every row with the same ones
    def check_settings(self, step: str, settings: dict[str, Any], recorded: Any = ...) -> bool:
        """Raise SettingsConflictError if the run recorded other `step` settings; True if it
        recorded these, False if it recorded none yet. `recorded`: what the run recorded, when the
        caller read it already (a RunState's `settings`); else it is read here."""
        if recorded is ...:
            recorded = self.read_json(self.settings_key(step))
        if recorded is None:
            return False
        differences = {k: (recorded[k], v) for k, v in settings.items() if k in recorded and recorded[k] != v}
        if differences:
            shown = ", ".join(f"{k} {old!r} (now {new!r})" for k, (old, new) in differences.items())
            raise SettingsConflictError(
                f"run {self.run_id!r} was started with other {_STEP_NAMES.get(step, step)} settings: {shown} "
                f"[{self.store.url(self.settings_key(step))}]; to resume it, repeat its settings; "
                "to start over with these, use a new run id", differences)
        return True

    def remember_settings(self, step: str, settings: dict[str, Any], recorded: Any = ...) -> None:
        """Record `step`'s settings on first use; later calls must bring the same ones.
        `recorded`: as for check_settings."""
        if not self.check_settings(step, settings, recorded):
            self.write_json(self.settings_key(step), {**settings, "recorded_at": utc_now()})

    # --- small helpers
    def read_json(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.store.get_bytes(key))
        except ObjectNotFoundError:
            return None

    def write_json(self, key: str, obj: Any) -> None:
        self.store.put_bytes(key, json.dumps(obj, indent=2, sort_keys=True).encode())

    def write_table(self, key: str, table: pa.Table) -> None:
        self.store.put_bytes(key, write_parquet_bytes(table))

    def read_table(self, key: str) -> pa.Table:
        return read_parquet_bytes(self.store.get_bytes(key))

    def manifest(self) -> dict[str, Any]:
        m = self.read_json(self.manifest_key)
        if m is None:
            raise FileNotFoundError(f"run {self.run_id!r} has no manifest at {self.store.url(self.manifest_key)}"
                                    " (run the shard step first)")
        return m

    def read_inputs(self, shard: int) -> list[Job]:
        try:
            return jobs_from_table(self.read_table(self.input_key(shard)))
        except ObjectNotFoundError:
            raise ConfigError(f"shard {shard} of run {self.run_id!r} has no input file "
                              f"{self.store.url(self.input_key(shard))}: run the shard step first, or check "
                              "--output, --run-id and --shard") from None

    def state(self, steps: Sequence[str] = ("ar", "dit")) -> RunState:
        """What the run holds, read once: its manifest, the settings `steps` recorded and the shards
        committed (verified). A job's checks and its start read the run through this, not key by key."""
        manifest = self.read_json(self.manifest_key)
        settings = {step: self.read_json(self.settings_key(step)) for step in steps}
        shards = manifest["num_shards"] if manifest is not None else 0
        return RunState(manifest, settings, frozenset(k for k in range(shards) if self.is_committed(k)))

    # --- commit state
    def commit_marker(self, shard: int) -> dict[str, Any] | None:
        return self.read_json(self.marker_key(shard))

    def is_committed(self, shard: int, verify: bool = True) -> bool:
        """True iff the marker exists (and, with verify, matches rows.parquet's bytes)."""
        marker = self.commit_marker(shard)
        if marker is None:
            return False
        if not verify:
            return True
        try:
            data = self.store.get_bytes(self.rows_key(shard))
        except ObjectNotFoundError:
            return False
        return hashlib.sha256(data).hexdigest() == marker.get("sha256")

    def completed_rows(self, shard: int) -> set[str]:
        """Ids of rows with a recorded result (done, whether ok or error)."""
        return set(self._records(shard))

    def _records(self, shard: int) -> dict[str, dict[str, Any]]:
        prefix = f"{self.shard_prefix(shard)}rows/"
        out: dict[str, dict[str, Any]] = {}
        for key in self.store.list(prefix):
            if key.endswith(".json"):
                rec = json.loads(self.store.get_bytes(key))
                out[rec["id"]] = rec
        return out

    def read_rows(self, shard: int) -> pa.Table:
        return self.read_table(self.rows_key(shard))

    def shard_writer(self, shard: int) -> ShardWriter:
        return ShardWriter(self, shard)

    def verify(self) -> list[str]:
        """Problems with the run as a whole: uncommitted shards, rows not covered exactly once."""
        manifest = self.manifest()
        problems = []
        for k in range(manifest["num_shards"]):
            if not self.is_committed(k):
                problems.append(f"shard {k} is not committed")
                continue
            try:
                check_coverage(self.read_inputs(k), self.read_rows(k).select(["id", "row_index"]).to_pylist())
            except CoverageError as exc:
                problems.append(f"shard {k}: {exc}")
        return problems


class ShardWriter:
    """Records finished rows of one shard one by one, then commits the shard.

    Rows whose record already exists (from an earlier, interrupted attempt) are not in
    `pending()`; input rows that failed validation become error rows at commit without being
    recorded. `commit()` refuses while any valid row has no record.
    """

    def __init__(self, layout: RunLayout, shard: int):
        self.layout = layout
        self.shard = shard
        self.jobs = layout.read_inputs(shard)
        self._by_id = {j.id: j for j in self.jobs if j.ok}
        self.started_at = utc_now()
        self._t0 = time.monotonic()
        self._records = layout._records(shard)

    @property
    def store(self) -> ObjectStore:
        return self.layout.store

    def pending(self, retry_errors: bool = False) -> list[Job]:
        """Valid input rows without a recorded result, in dataset order.

        With `retry_errors`, rows whose recorded result is an error are offered again (a step
        that records a transient failure can retry it on the next attempt; the new record
        replaces the old one)."""
        def done(job: Job) -> bool:
            rec = self._records.get(job.id)
            return rec is not None and not (retry_errors and rec.get("status") != "ok")

        return [j for j in self.jobs if j.ok and not done(j)]

    def _job(self, row_id: str) -> Job:
        job = self._by_id.get(row_id)
        if job is None:
            raise KeyError(f"row {row_id!r} is not a valid input row of shard {self.shard}")
        return job

    def record_ok(self, row_id: str, image: Any, *, cot_text: str | None = None, width: int | None = None,
                  height: int | None = None, kv_path: str | None = None, kv_reason: str | None = None,
                  **metrics: Any) -> dict[str, Any]:
        """Store the row's image (PIL image or encoded PNG bytes), then its record."""
        job = self._job(row_id)
        if isinstance(image, (bytes, bytearray)):
            png = bytes(image)
            if width is None or height is None:
                from PIL import Image

                with Image.open(io.BytesIO(png)) as img:
                    width, height = img.size
        else:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            png = buf.getvalue()
            width, height = image.size if width is None or height is None else (width, height)
        image_key = self.layout.image_key(self.shard, row_id)
        self.store.put_bytes(image_key, png)  # the image first: a record always has its image
        return self._record(job, dict(status="ok", error=None, image_key=image_key, cot_text=cot_text,
                                      width=width, height=height, kv_path=kv_path, kv_reason=kv_reason,
                                      **metrics))

    def record_error(self, row_id: str, error: str, **metrics: Any) -> dict[str, Any]:
        """The row failed while being processed; it ends as an error row saying `error`."""
        if not error:
            raise ValueError("record_error needs a message saying what went wrong")
        return self._record(self._job(row_id), dict(status="error", error=str(error), **metrics))

    def _record(self, job: Job, fields: dict[str, Any]) -> dict[str, Any]:
        rec = {"id": job.id, "row_index": job.row_index, **fields}
        data = json.dumps(rec, sort_keys=True, default=_scalar).encode()
        self.store.put_bytes(self.layout.row_record_key(self.shard, job.id), data)
        self._records[job.id] = rec
        return rec

    def output_rows(self) -> list[dict[str, Any]]:
        """One output row per input row, in dataset order; raises if a valid row is unfinished."""
        missing = [j.id for j in self.pending()]
        if missing:
            raise ShardNotReadyError(f"shard {self.shard}: {len(missing)} row(s) have no result yet: "
                                     f"{missing[:10]}{' ...' if len(missing) > 10 else ''}")
        rows = []
        for job in self.jobs:
            if job.ok:
                rows.append(self._records[job.id])
            else:  # rejected at shard time: carried through as an error row
                rows.append({"id": job.id, "row_index": job.row_index, "status": "error", "error": job.error})
        check_coverage(self.jobs, rows)
        return rows

    def commit(self) -> dict[str, Any]:
        """Write rows.parquet, then the marker (last). Committing a committed shard is a no-op."""
        if self.layout.is_committed(self.shard):
            return self.layout.commit_marker(self.shard) or {}
        rows = self.output_rows()
        data = write_parquet_bytes(rows_table(rows))
        self.store.put_bytes(self.layout.rows_key(self.shard), data)
        marker = {
            "run_id": self.layout.run_id,
            "shard": self.shard,
            "rows": len(rows),
            "ok": sum(r["status"] == "ok" for r in rows),
            "failed": sum(r["status"] != "ok" for r in rows),
            "sha256": hashlib.sha256(data).hexdigest(),
            "started_at": self.started_at,
            "committed_at": utc_now(),
            "attempt_s": round(time.monotonic() - self._t0, 3),
        }
        self.layout.write_json(self.layout.marker_key(self.shard), marker)
        return marker

