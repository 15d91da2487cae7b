"""Job datasets (Parquet): schemas, reading from a path or s3://, row validation, sharding.

Edit dataset columns (one row = one edit job):
    id               string   optional column; when the column is absent, ids are
                              "row-{index:06d}" with index = position in the dataset (files in
                              sorted key order, rows in file order), so they are stable across runs
    instruction      string   required, non-empty
    image            binary   the input image bytes (PNG/JPEG/...), or
    image_uri        string   where to fetch it: absolute path, file://, s3://bucket/key, or a
                              path relative to the dataset's directory / prefix
                              (a Hugging Face image struct {bytes, path} is accepted in `image`)
    reference_image  binary   optional second conditioning image (or reference_image_uri)
    seed             int64    optional, 0 <= seed < 2**63
    size             string   optional: "auto" (default) or "WIDTHxHEIGHT", e.g. "1024x1024"
Generation dataset columns: id (optional, as above), prompt (required), seed, size.

`validate_rows` returns `(valid, errors)`: every input row lands in exactly one list; an error
row keeps its id and position and says what is wrong ("image is not a decodable image: ...").
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .objectstore import ObjectNotFoundError, ObjectStore, is_s3_uri, open_object_store, split_uri

Kind = Literal["edit", "generate"]
KINDS: tuple[str, ...] = ("edit", "generate")
TEXT_COLUMN = {"edit": "instruction", "generate": "prompt"}
DEFAULT_MAX_PROMPT_TOKENS = 4096

# Shard files (inputs/{k}.parquet) use one normalised schema for both kinds: images are resolved
# to bytes at shard time so the AR/DiT steps never need the original dataset's storage.
SHARD_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("row_index", pa.int64()),  # position in the dataset: the unit of "exactly one output row"
        ("kind", pa.string()),
        ("text", pa.string()),  # instruction (edit) or prompt (generate)
        ("image", pa.binary()),
        ("image_uri", pa.string()),
        ("reference_image", pa.binary()),
        ("seed", pa.int64()),
        ("size", pa.string()),
        ("error", pa.string()),  # null for a valid row; else what is wrong with it
    ]
)


class DatasetError(ValueError):
    """The dataset as a whole cannot be read (missing files, missing required column, ...)."""


@dataclass
class Job:
    """One row of work, valid or not (`error` set)."""

    id: str
    row_index: int
    kind: str
    text: str | None
    image: bytes | None = None
    image_uri: str | None = None
    reference_image: bytes | None = None
    seed: int | None = None
    size: str = "auto"
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def effective_seed(self, base_seed: int = 0) -> int:
        """The row's seed, or one derived from (base_seed, id): reruns of a row draw the same noise."""
        if self.seed is not None:
            return self.seed
        digest = hashlib.sha256(f"{base_seed}:{self.id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)

    def size_wh(self) -> tuple[int, int] | None:
        """(width, height) for an explicit size, None for "auto"."""
        return parse_size(self.size)

    def pil_images(self) -> list[Any]:
        """The conditioning images as RGB PIL images (input first, then the reference)."""
        from PIL import Image

        return [Image.open(io.BytesIO(b)).convert("RGB") for b in (self.image, self.reference_image) if b]

    def to_record(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SHARD_SCHEMA.names}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Job:
        fields = {name: rec.get(name) for name in SHARD_SCHEMA.names}
        fields["size"] = fields["size"] or "auto"
        return cls(**fields)


_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_size(size: str | None) -> tuple[int, int] | None:
    """'auto'/None/'' -> None; '1024x768' -> (1024, 768); anything else raises ValueError."""
    if size is None or str(size).strip().lower() in ("", "auto"):
        return None
    m = _SIZE_RE.match(str(size))
    if not m:
        raise ValueError(f"size {size!r} is not 'auto' or 'WIDTHxHEIGHT'")
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0:
        raise ValueError(f"size {size!r} has a zero dimension")
    return w, h


def default_is_supported_size(width: int, height: int) -> bool:
    """Default rule: multiples of 16 (the VAE downsample) between 64 and 4096 pixels a side."""
    return all(64 <= v <= 4096 and v % 16 == 0 for v in (width, height))


def utf8_bytes(text: str) -> int:
    """Default token counter: UTF-8 bytes (an upper bound for byte-level tokenizers)."""
    return len(text.encode("utf-8"))


# ----------------------------------------------------------------------------------------- reading


@dataclass
class RawDataset:
    """The dataset's rows as read, plus where they came from."""

    uri: str
    table: pa.Table
    files: list[str]
    fingerprint: str  # sha256 over the files' names and bytes: "the same dataset" check
    base: ObjectStore = field(repr=False)  # for resolving relative image_uri values


def read_dataset(uri: str) -> RawDataset:
    """Read one Parquet file or every *.parquet under a directory / S3 prefix (sorted by key)."""
    uri = str(uri)
    local_file = not is_s3_uri(uri) and _is_local_file(uri)
    if uri.endswith(".parquet") or local_file:
        parent, name = split_uri(uri)
        base = open_object_store(parent)
        keys = [name]
    else:
        base = open_object_store(uri)
        keys = [k for k in base.list("") if k.endswith(".parquet")]
        if not keys:
            raise DatasetError(f"no *.parquet files under {base.url()}")
    tables, digest = [], hashlib.sha256()
    for key in keys:
        try:
            data = base.get_bytes(key)
        except ObjectNotFoundError:
            raise DatasetError(f"dataset file {base.url(key)} does not exist") from None
        digest.update(key.encode() + b"\0" + hashlib.sha256(data).digest())
        try:
            tables.append(pq.read_table(io.BytesIO(data)))
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{base.url(key)} is not a readable Parquet file: {exc}") from None
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DatasetError(f"the Parquet files under {uri} have incompatible schemas: {exc}") from None
    return RawDataset(uri=uri, table=table, files=[base.url(k) for k in keys],
                      fingerprint=digest.hexdigest(), base=base)


def _is_local_file(uri: str) -> bool:
    from pathlib import Path

    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return Path(path).is_file()


def check_columns(table: pa.Table, kind: str) -> None:
    """Dataset-level problems (a required column missing everywhere) are one clear error."""
    if kind not in KINDS:
        raise DatasetError(f"unknown dataset kind {kind!r} (expected one of {', '.join(KINDS)})")
    cols = set(table.column_names)
    need = TEXT_COLUMN[kind]
    if need not in cols:
        raise DatasetError(f"{kind} dataset has no {need!r} column (columns: {sorted(cols)})")
    if kind == "edit" and not cols & {"image", "image_uri"}:
        raise DatasetError(f"edit dataset needs an 'image' or 'image_uri' column (columns: {sorted(cols)})")


# -------------------------------------------------------------------------------------- validation


class _ImageFetcher:
    """Reads image_uri values: absolute paths, file://, s3://, or keys relative to the dataset."""

    def __init__(self, base: ObjectStore | None):
        self.base = base
        self._stores: dict[str, ObjectStore] = {}

    def __call__(self, uri: str) -> bytes:
        if is_s3_uri(uri) or uri.startswith("file://") or uri.startswith("/"):
            parent, name = split_uri(uri)
            if parent not in self._stores:
                self._stores[parent] = open_object_store(parent)
            return self._stores[parent].get_bytes(name)
        if self.base is None:
            raise ValueError(f"relative image_uri {uri!r} but the dataset location is unknown")
        return self.base.get_bytes(uri)


def _image_problem(data: bytes, what: str) -> str | None:
    """None if PIL can fully decode the bytes, else why not."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                img.load()  # verify() only checks headers; load() decodes every pixel
                if img.width <= 0 or img.height <= 0:
                    return f"{what} has zero size"
    except Exception as exc:  # PIL raises many types for corrupt data
        # PIL messages may embed object addresses ("<_io.BytesIO object at 0x..>"): drop them so
        # the same bad row always gets the same error text (shard files stay deterministic).
        detail = re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", str(exc))
        return f"{what} is not a decodable image: {type(exc).__name__}: {detail}"
    return None


def _as_bytes(value: Any) -> bytes | None:
    """Binary column value, or a Hugging Face image struct {bytes, path}."""
    if isinstance(value, dict):
        value = value.get("bytes")
    if value is None:
        return None
    return bytes(value)


def _struct_path(value: Any) -> str | None:
    return value.get("path") or None if isinstance(value, dict) else None


def validate_rows(
    rows: Sequence[dict[str, Any]],
    kind: str,
    *,
    count_tokens: Callable[[str], int] = utf8_bytes,
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS,
    is_supported_size: Callable[[int, int], bool] = default_is_supported_size,
    fetch: Callable[[str], bytes] | None = None,
    start_index: int = 0,
) -> tuple[list[Job], list[Job]]:
    """Validate dataset rows (dicts as from `Table.to_pylist()`); returns (valid, errors).

    Every input row ends in exactly one of the two lists. Images given by URI are fetched (with
    `fetch`) so that shard files carry the bytes. Duplicate ids: the first row keeps the id,
    later ones become error rows naming the first position.
    """
    if kind not in KINDS:
        raise DatasetError(f"unknown dataset kind {kind!r}")
    fetch = fetch or _ImageFetcher(None)
    text_col = TEXT_COLUMN[kind]
    valid: list[Job] = []
    errors: list[Job] = []
    seen: dict[str, int] = {}
    for offset, row in enumerate(rows):
        index = start_index + offset
        problems: list[str] = []

        raw_id = row.get("id") if "id" in row else f"row-{index:06d}"
        job_id = "" if raw_id is None else str(raw_id)
        if not job_id.strip():
            problems.append("id is missing or empty")
            job_id = f"row-{index:06d}"  # a name for the error row; the problem says why
        elif job_id in seen:
            problems.append(f"duplicate id {job_id!r} (first used by row {seen[job_id]})")
        else:
            seen[job_id] = index

        text = row.get(text_col)
        if text is None or not str(text).strip():
            problems.append(f"{text_col} is missing or empty")
            text = None if text is None else str(text)
        else:
            text = str(text)
            if max_prompt_tokens is not None:
                n = count_tokens(text)
                if n > max_prompt_tokens:
                    problems.append(f"{text_col} is {n} tokens, over the budget of {max_prompt_tokens}")

        seed = row.get("seed")
        if seed is not None:
            try:
                seed = int(seed)
                if not 0 <= seed < 2**63:
                    raise ValueError
            except (TypeError, ValueError):
                problems.append(f"seed {row.get('seed')!r} is not an integer in [0, 2**63)")
                seed = None

        size = row.get("size")
        size = "auto" if size is None or not str(size).strip() else str(size).strip().lower()
        try:
            wh = parse_size(size)
            if wh is not None and not is_supported_size(*wh):
                problems.append(f"size {size!r} is not supported")
        except ValueError as exc:
            problems.append(str(exc))

        image = image_uri = reference = None
        if kind == "edit":
            image, image_uri, problem = _load_image(row, "image", fetch, required=True)
            if problem:
                problems.append(problem)
            reference, _, problem = _load_image(row, "reference_image", fetch, required=False)
            if problem:
                problems.append(problem)

        job = Job(id=job_id, row_index=index, kind=kind, text=text, image=image, image_uri=image_uri,
                  reference_image=reference, seed=seed, size=size,
                  error="; ".join(problems) if problems else None)
        (errors if problems else valid).append(job)
    return valid, errors


def _load_image(row: dict[str, Any], name: str, fetch: Callable[[str], bytes],
                required: bool) -> tuple[bytes | None, str | None, str | None]:
    """(bytes, uri, problem) for the `name` / `name_uri` pair of columns."""
    value = row.get(name)
    data = _as_bytes(value)
    uri = row.get(f"{name}_uri") or _struct_path(value)
    if data is None and uri:
        try:
            data = fetch(str(uri))
        except ObjectNotFoundError:
            return None, str(uri), f"{name}_uri {uri!r} does not exist"
        except Exception as exc:
            return None, str(uri), f"{name}_uri {uri!r} could not be read: {type(exc).__name__}: {exc}"
    if data is None or len(data) == 0:
        return None, uri, (f"{name} is missing or empty" if required else None)
    return data, (str(uri) if uri else None), _image_problem(data, name)


def validate_dataset(dataset: RawDataset, kind: str, **options: Any) -> tuple[list[Job], list[Job]]:
    """Check columns, then validate every row (images by URI resolved against the dataset)."""
    check_columns(dataset.table, kind)
    return validate_rows(dataset.table.to_pylist(), kind, fetch=_ImageFetcher(dataset.base), **options)


# ---------------------------------------------------------------------------------------- sharding


def shard_ranges(num_rows: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [start, stop) ranges of row positions, one per shard.

    Deterministic: shard k always gets rows k*n//N .. (k+1)*n//N - 1 of the dataset order.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return [(k * num_rows // num_shards, (k + 1) * num_rows // num_shards) for k in range(num_shards)]


def split_into_shards(jobs: Iterable[Job], num_shards: int) -> list[list[Job]]:
    """Valid and error rows together, by dataset position, into `num_shards` lists."""
    ordered = sorted(jobs, key=lambda j: j.row_index)
    return [ordered[a:b] for a, b in shard_ranges(len(ordered), num_shards)]


def jobs_to_table(jobs: Sequence[Job]) -> pa.Table:
    return pa.Table.from_pylist([j.to_record() for j in jobs], schema=SHARD_SCHEMA)


def jobs_from_table(table: pa.Table) -> list[Job]:
    missing = set(SHARD_SCHEMA.names) - set(table.column_names)
    if missing:
        raise DatasetError(f"shard file lacks columns {sorted(missing)}")
    return [Job.from_record(rec) for rec in table.select(SHARD_SCHEMA.names).to_pylist()]


def write_parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def read_parquet_bytes(data: bytes) -> pa.Table:
    return pq.read_table(io.BytesIO(data))


def ids_digest(ids: Iterable[str]) -> str:
    """Order-sensitive digest of a list of ids (for manifests)."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()
