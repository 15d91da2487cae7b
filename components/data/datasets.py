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

`read_dataset(uri)` opens the files (footers only); `iter_jobs` streams the rows through a
`RowValidator`, one Job per row, valid or carrying `error` ("image is not a decodable image: ...",
"instruction is 5000 tokens, over the budget of 4096", "size '1000x999' is not supported",
"duplicate id 'a' (first used by row 3)", ...). `validate_rows` / `validate_dataset` return
`(valid, errors)`: every input row lands in exactly one list, keeping its id and position.
The AR step can re-check rows with the real tokenizer: `RowValidator(kind, count_tokens=...)`.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from .objectstore import (
    ObjectNotFoundError,
    ObjectStore,
    TransientStorageError,
    is_s3_uri,
    is_transient,
    open_object_store,
    split_uri,
)

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
        """The conditioning images as 8-bit RGB PIL images (input first, then the reference); a
        16-bit or float image is scaled to 8 bits, not clipped (see `images.to_rgb`)."""
        from PIL import Image

        from .images import to_rgb

        return [to_rgb(Image.open(io.BytesIO(b))) for b in (self.image, self.reference_image) if b]

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


@dataclass(frozen=True)
class SizeRule:
    """An `is_supported_size(width, height)` that can say which sizes it takes (for error rows)."""

    check: Callable[[int, int], bool]
    supported: str  # e.g. "1024x1024, 1088x960, ..."

    def __call__(self, width: int, height: int) -> bool:
        return self.check(width, height)


def utf8_bytes(text: str) -> int:
    """Default token counter: UTF-8 bytes (an upper bound for byte-level tokenizers)."""
    return len(text.encode("utf-8"))


# ----------------------------------------------------------------------------------------- reading


@dataclass
class DatasetSource:
    """A dataset opened for streaming: only the Parquet footers have been read.

    Rows are read file by file, batch by batch (`iter_rows`), so the shard step's memory stays
    bounded by one batch, whatever the dataset's size.
    """

    uri: str
    base: ObjectStore = field(repr=False)  # also resolves relative image_uri values
    keys: list[str]
    row_counts: list[int]
    file_columns: list[list[str]]
    fingerprint: str  # sha256 over the files' names and content ids: "the same dataset" check

    @property
    def num_rows(self) -> int:
        return sum(self.row_counts)

    @property
    def files(self) -> list[str]:
        return [self.base.url(k) for k in self.keys]

    @property
    def has_ids(self) -> bool:
        return all("id" in cols for cols in self.file_columns)

    def iter_rows(self, batch_size: int = 256) -> Iterator[dict[str, Any]]:
        for key, expected in zip(self.keys, self.row_counts, strict=True):
            seen = 0
            with self.base.open_reader(key) as f:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
                    seen += batch.num_rows
                    yield from batch.to_pylist()
            if seen != expected:
                raise DatasetError(f"{self.base.url(key)} changed while being read ({expected} rows, then {seen})")

    def read_table(self) -> pa.Table:
        """Everything in memory at once (small datasets, tests)."""
        tables = []
        for key in self.keys:
            with self.base.open_reader(key) as f:
                tables.append(pq.read_table(f))
        return pa.concat_tables(tables, promote_options="permissive")


def read_dataset(uri: str) -> DatasetSource:
    """Open one Parquet file, or every *.parquet under a directory / S3 prefix (sorted by key)."""
    uri = str(uri)
    if uri.endswith(".parquet") or (not is_s3_uri(uri) and _is_local_file(uri)):
        parent, name = split_uri(uri)
        base = open_object_store(parent)
        keys = [name]
    else:
        base = open_object_store(uri)
        keys = [k for k in base.list("") if k.endswith(".parquet")]
        if not keys:
            raise DatasetError(f"no *.parquet files under {base.url()}")
    digest = hashlib.sha256()
    counts, columns = [], []
    for key in keys:
        try:
            digest.update(f"{key}\0{base.content_id(key)}\n".encode())
            with base.open_reader(key) as f:
                meta = pq.ParquetFile(f)
                counts.append(meta.metadata.num_rows)
                columns.append(meta.schema_arrow.names)
        except ObjectNotFoundError:
            raise DatasetError(f"dataset file {base.url(key)} does not exist") from None
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{base.url(key)} is not a readable Parquet file: {exc}") from None
    return DatasetSource(uri=uri, base=base, keys=keys, row_counts=counts, file_columns=columns,
                         fingerprint=digest.hexdigest())


def _is_local_file(uri: str) -> bool:
    from pathlib import Path

    path = uri[len("file://"):] if uri.startswith("file://") else uri
    return Path(path).is_file()


def check_columns(source: DatasetSource, kind: str) -> None:
    """Dataset-level problems (a required column missing from a file) are one clear error."""
    if kind not in KINDS:
        raise DatasetError(f"unknown dataset kind {kind!r} (expected one of {', '.join(KINDS)})")
    need = TEXT_COLUMN[kind]
    for url, cols in zip(source.files, source.file_columns, strict=True):
        if need not in cols:
            raise DatasetError(f"{kind} dataset file {url} has no {need!r} column (columns: {sorted(cols)})")
        if kind == "edit" and not set(cols) & {"image", "image_uri"}:
            raise DatasetError(f"edit dataset file {url} needs an 'image' or 'image_uri' column "
                               f"(columns: {sorted(cols)})")


# -------------------------------------------------------------------------------------- validation


# An image_uri read that fails for a reason that may pass (S3 5xx, timeout, dropped connection) is
# tried this many times in all (each try is itself retried by botocore), BACKOFF_S, 2 x, ... apart;
# then the step fails retryably instead of writing a permanent error row.
IMAGE_READ_ATTEMPTS = 3
IMAGE_READ_BACKOFF_S = 2.0


class _ImageFetcher:
    """Reads image_uri values: absolute paths, file://, s3://, or keys relative to the dataset.

    Transient failures are retried; one that persists raises TransientStorageError (the shard step
    exits 1 and is retried, with nothing committed); other failures are the row's problem."""

    def __init__(self, base: ObjectStore | None):
        self.base = base
        self._stores: dict[str, ObjectStore] = {}

    def __call__(self, uri: str) -> bytes:
        for attempt in range(1, IMAGE_READ_ATTEMPTS + 1):
            try:
                return self._read(uri)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if attempt == IMAGE_READ_ATTEMPTS:
                    raise TransientStorageError(f"image_uri {uri!r} could not be read after {attempt} tries, for a "
                                                f"reason that may pass ({type(exc).__name__}: {exc}); the step "
                                                "fails so that it is retried") from exc
            time.sleep(IMAGE_READ_BACKOFF_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _read(self, uri: str) -> bytes:
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


class RowValidator:
    """Turns dataset rows into Jobs, one at a time (remembers ids to catch duplicates).

    An error Job keeps its id and position and names every problem found in the row.
    Duplicate ids: the first row keeps the id, later ones are errors naming the first position.
    """

    def __init__(
        self,
        kind: str,
        *,
        count_tokens: Callable[[str], int] = utf8_bytes,
        max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS,
        is_supported_size: Callable[[int, int], bool] = default_is_supported_size,
        fetch: Callable[[str], bytes] | None = None,
    ):
        if kind not in KINDS:
            raise DatasetError(f"unknown dataset kind {kind!r} (expected one of {', '.join(KINDS)})")
        self.kind = kind
        self.text_col = TEXT_COLUMN[kind]
        self.count_tokens = count_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.is_supported_size = is_supported_size
        self.fetch = fetch or _ImageFetcher(None)
        self.seen: dict[str, int] = {}

    def __call__(self, row: dict[str, Any], index: int) -> Job:
        problems: list[str] = []
        job_id = self._id(row, index, problems)
        text = self._text(row, problems)
        seed = self._seed(row, problems)
        size = self._size(row, problems)
        image = image_uri = reference = None
        if self.kind == "edit":
            image, image_uri, problem = _load_image(row, "image", self.fetch, required=True)
            problems += [problem] if problem else []
            reference, _, problem = _load_image(row, "reference_image", self.fetch, required=False)
            problems += [problem] if problem else []
        return Job(id=job_id, row_index=index, kind=self.kind, text=text, image=image, image_uri=image_uri,
                   reference_image=reference, seed=seed, size=size,
                   error="; ".join(problems) if problems else None)

    def _id(self, row: dict[str, Any], index: int, problems: list[str]) -> str:
        raw = row.get("id") if "id" in row else f"row-{index:06d}"
        job_id = "" if raw is None else str(raw)
        if not job_id.strip():
            problems.append("id is missing or empty")
            return self._name_for_error_row(index)
        if job_id in self.seen:
            problems.append(f"duplicate id {job_id!r} (first used by row {self.seen[job_id]})")
        else:
            self.seen[job_id] = index
        return job_id

    def _name_for_error_row(self, index: int) -> str:
        """A name for a row without an id (the problem says why) that no other row of the dataset
        has: not `row-{index}` (a real row may be named so, and the two records would be one), and
        kept, so a later row with the same id is a duplicate."""
        name, n = f"(empty id: row {index})", 1
        while name in self.seen:
            n += 1
            name = f"(empty id: row {index}) #{n}"
        self.seen[name] = index
        return name

    def _text(self, row: dict[str, Any], problems: list[str]) -> str | None:
        text = row.get(self.text_col)
        if text is None or not str(text).strip():
            problems.append(f"{self.text_col} is missing or empty")
            return None if text is None else str(text)
        text = str(text)
        if self.max_prompt_tokens is not None:
            n = self.count_tokens(text)
            if n > self.max_prompt_tokens:
                problems.append(f"{self.text_col} is {n} tokens, over the budget of {self.max_prompt_tokens}")
        return text

    @staticmethod
    def _seed(row: dict[str, Any], problems: list[str]) -> int | None:
        seed = row.get("seed")
        if seed is None:
            return None
        try:
            value = int(seed)
            if 0 <= value < 2**63 and value == seed:
                return value
        except (TypeError, ValueError):
            pass
        problems.append(f"seed {seed!r} is not an integer in [0, 2**63)")
        return None

    def _size(self, row: dict[str, Any], problems: list[str]) -> str:
        size = row.get("size")
        size = "auto" if size is None or not str(size).strip() else str(size).strip().lower()
        try:
            wh = parse_size(size)
            if wh is not None and not self.is_supported_size(*wh):
                supported = getattr(self.is_supported_size, "supported", None)
                problems.append(f"size {size!r} is not supported" + (
                    f" (use auto or one of {supported})" if supported else ""))
        except ValueError as exc:
            problems.append(str(exc))
        return size


def validate_rows(rows: Sequence[dict[str, Any]], kind: str, *, start_index: int = 0,
                  **options: Any) -> tuple[list[Job], list[Job]]:
    """Validate rows (dicts as from `Table.to_pylist()`); returns (valid, errors).

    Every input row ends in exactly one of the two lists. Options: see RowValidator.
    """
    check = RowValidator(kind, **options)
    jobs = [check(row, start_index + i) for i, row in enumerate(rows)]
    return [j for j in jobs if j.ok], [j for j in jobs if not j.ok]


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
        except TransientStorageError:
            raise  # not the row's fault: the step fails retryably
        except Exception as exc:
            return None, str(uri), f"{name}_uri {uri!r} could not be read: {type(exc).__name__}: {exc}"
    if data is None or len(data) == 0:
        return None, uri, (f"{name} is missing or empty" if required else None)
    return data, (str(uri) if uri else None), _image_problem(data, name)


def iter_jobs(source: DatasetSource, kind: str, batch_size: int = 256, **options: Any) -> Iterator[Job]:
    """Stream the dataset's rows as Jobs (valid or not), in dataset order."""
    check_columns(source, kind)
    check = RowValidator(kind, fetch=_ImageFetcher(source.base), **options)
    for index, row in enumerate(source.iter_rows(batch_size)):
        yield check(row, index)


def validate_dataset(source: DatasetSource, kind: str, **options: Any) -> tuple[list[Job], list[Job]]:
    """All of `iter_jobs` in memory, split into (valid, errors)."""
    jobs = list(iter_jobs(source, kind, **options))
    return [j for j in jobs if j.ok], [j for j in jobs if not j.ok]


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


class IdsDigest:
    """Order-sensitive digest of a sequence of ids, built incrementally (for manifests)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, row_id: str) -> None:
        self._h.update(json.dumps(row_id).encode() + b"\n")

    def hexdigest(self) -> str:
        return self._h.hexdigest()
