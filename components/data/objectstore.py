"""Object storage: one small interface, a local-directory backend and an S3 backend.

Keys are "/"-separated paths relative to the store's root (a directory, or `bucket/prefix` on S3).
Every write is atomic: a reader sees the whole old object, the whole new one, or nothing. That is
what lets the commit protocol in `runs.py` treat "object exists" as "object complete".

    store = open_object_store("s3://bucket/outputs")   # or "/data/outputs", "file:///data/outputs"
    store.put_bytes("run1/summary.json", b"{}")
    store.get_bytes("run1/summary.json")

S3 settings come from the environment unless passed in: endpoint from `ARDIT_S3_ENDPOINT` or
`AWS_ENDPOINT_URL` (unset: AWS itself), region from `AWS_REGION` / `AWS_DEFAULT_REGION`
(default us-east-1), credentials through boto3's usual chain (`AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY`, profiles, instance roles). Retry attempts and mode can be set with
`ARDIT_S3_MAX_ATTEMPTS` / `ARDIT_S3_RETRY_MODE` (defaults 25 / "standard").

A request that fails for a passing reason (5xx, throttling, a refused or dropped connection) is
retried by botocore up to 5 times in a row (its backoff for a 5xx is well under a second), then
again after 2, 4, 8, 16 s, until the round in which `max_attempts` attempts have failed: an outage
of a few seconds (a restarting gateway) costs a wait, not the job. The final error says how many attempts failed and
over how long.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

MiB = 1024 * 1024
# Temp files of in-flight local writes start with this; listings never show them.
_TMP_PREFIX = ".ardit-tmp-"


class ObjectStoreError(RuntimeError):
    """A storage operation failed for good (after retries where retrying makes sense)."""


class S3AccessError(ObjectStoreError):
    """The S3 credentials are missing, refused, or lack a permission (retrying will not help)."""


class BucketNotFoundError(ObjectStoreError):
    """The bucket does not exist."""


class TransientStorageError(ObjectStoreError):
    """A failure that may pass on its own (HTTP 5xx, throttling, timeouts, a dropped or refused
    connection), still failing after the retries: the step should fail retryably (exit 1)."""


DEFAULT_MAX_ATTEMPTS = 25
QUICK_ATTEMPTS = 5  # attempts botocore makes in a row (its own backoff: well under a second for a 5xx)
ROUND_BACKOFF_S = (2.0, 4.0, 8.0, 16.0)  # waits between botocore's rounds (the last one repeats)

# HTTP statuses and error codes of failures that may pass on their own
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                    "ServiceUnavailable", "RequestLimitExceeded"}


def is_transient(exc: BaseException) -> bool:
    """Whether a storage failure may pass on its own (worth retrying) rather than being about the
    key, the data or the setup (a missing object, refused credentials, a bad request)."""
    if isinstance(exc, ObjectStoreError):
        return isinstance(exc, TransientStorageError)
    try:
        from s3transfer.exceptions import RetriesExceededError  # a managed download's body kept failing
    except ImportError:
        return isinstance(exc, (ConnectionError, TimeoutError))
    return isinstance(exc, (*_streaming_errors(), RetriesExceededError))


# error codes that mean "these credentials": no retry, and say where credentials come from
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
               "AllAccessDisabled"}
_CREDENTIALS_HINT = ("set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE; in the cluster the "
                     "ardit-s3 Secret) for a key that may read and write this bucket")


def _streaming_errors() -> tuple[type[BaseException], ...]:
    """Failures while reading a response body that a new request may not hit again."""
    from botocore.exceptions import (
        ConnectionClosedError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )
    from urllib3.exceptions import HTTPError as Urllib3Error

    return (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError, Urllib3Error,
            ConnectionError, TimeoutError)


class ObjectNotFoundError(ObjectStoreError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "object not found"


def check_key(key: str) -> str:
    """Reject keys that could escape the store root or mean different things on disk and on S3."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"object key {key!r} must be relative, without backslashes or NUL")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"object key {key!r} has an empty, '.' or '..' segment")
    if parts[-1].startswith(_TMP_PREFIX):
        raise ValueError(f"object key {key!r} uses the reserved temp-file prefix")
    return key


def join_key(*parts: str) -> str:
    """Join key segments with '/', ignoring empty ones."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class ObjectStore(ABC):
    """What the steps need from storage; nothing more."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Raises ObjectNotFoundError when the key does not exist."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys starting with `prefix` (a plain string prefix, as on S3), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one key; deleting a missing key is not an error."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Object size in bytes; raises ObjectNotFoundError."""

    @abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from offset `start` (fewer at the end of the object)."""

    @abstractmethod
    def content_id(self, key: str) -> str:
        """A string that changes when the object's content changes (local: sha256; S3: ETag + size)."""

    def open_reader(self, key: str) -> io.RawIOBase:
        """A seekable read-only file over the object, fetching only the ranges read (so pyarrow
        can read a Parquet footer or one row group without downloading the whole file)."""
        return RangeReader(self, key)

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike[str]) -> None: ...

    @abstractmethod
    def get_file(self, key: str, path: str | os.PathLike[str]) -> None: ...

    @abstractmethod
    def url(self, key: str = "") -> str:
        """Where the key lives, for people and for other tools (a path, or s3://bucket/key)."""

    @abstractmethod
    def child(self, prefix: str) -> ObjectStore:
        """The same storage, rooted at `prefix`."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key starting with `prefix`; returns how many. An empty prefix is refused."""
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix (refusing to empty the store)")
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)

    def sweep_partial_writes(self, prefix: str) -> int:
        """Remove what writes killed midway left under `prefix` (none can be left on S3, where an
        object appears whole or not at all); returns how many. Only for a prefix no live writer
        writes to: a shard at the start of its step."""
        return 0

    def put_text(self, key: str, text: str) -> None:
        self.put_bytes(key, text.encode("utf-8"))

    def get_text(self, key: str) -> str:
        return self.get_bytes(key).decode("utf-8")


class RangeReader(io.RawIOBase):
    """Seekable file interface over `ObjectStore.get_range`."""

    def __init__(self, store: ObjectStore, key: str):
        super().__init__()
        self.store, self.key = store, key
        self.length = store.size(key)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.length - self.pos)
        if want <= 0:
            return 0
        data = self.store.get_range(self.key, self.pos, want)
        n = len(data)
        memoryview(buffer)[:n] = data
        self.pos += n
        return n


class LocalObjectStore(ObjectStore):
    """A directory. Writes go to a temp file in the target directory, then `os.replace` (atomic)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._atomic_write(key, lambda f: f.write(data))

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as src:
            self._atomic_write(key, lambda f: shutil.copyfileobj(src, f, 8 * MiB))

    def _atomic_write(self, key: str, write: Any) -> None:
        target = self._path(key)
        for attempt in range(3):  # a concurrent delete() may remove the emptied parent dir
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=target.parent)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the name points at it
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"no object {self.url(key)}") from None

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFoundError(f"no object {self.url(key)}")
        dest = Path(path)
        tmp = dest.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFoundError(f"no object {self.url(key)}")
        return path.stat().st_size

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(length)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"no object {self.url(key)}") from None

    def open_reader(self, key: str) -> io.RawIOBase:
        if not self.exists(key):
            raise ObjectNotFoundError(f"no object {self.url(key)}")
        return open(self._path(key), "rb", buffering=0)

    def content_id(self, key: str) -> str:
        digest = hashlib.sha256()
        with self.open_reader(key) as f:
            for block in iter(lambda: f.read(8 * MiB), b""):
                digest.update(block)
        return digest.hexdigest()

    def list(self, prefix: str = "") -> list[str]:
        # Walk only the directory the prefix points into, then filter by string prefix.
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root.joinpath(*base_dir.split("/")) if base_dir else self.root
        if not start.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(start):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(_TMP_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def sweep_partial_writes(self, prefix: str) -> int:
        """The temp files of atomic writes whose process was killed before the rename (invisible to
        `list`, but on the disk) under `prefix`'s directory."""
        start = self.root.joinpath(*check_key(prefix.rstrip("/")).split("/"))
        removed = 0
        for tmp in (start.rglob(f"{_TMP_PREFIX}*") if start.is_dir() else ()):
            try:
                tmp.unlink()
                removed += 1
            except OSError:
                pass  # gone meanwhile, or not ours to remove
        return removed

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Tidy empty parent directories so listings and `ls` stay clean.
        parent = path.parent
        while parent != self.root and parent.is_dir():
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def url(self, key: str = "") -> str:
        return str(self._path(key)) if key else str(self.root)

    def child(self, prefix: str) -> LocalObjectStore:
        return LocalObjectStore(self._path(prefix)) if prefix else self


class S3ObjectStore(ObjectStore):
    """An S3 bucket (AWS or any S3-compatible server such as SeaweedFS), through boto3.

    Large objects go through boto3's managed transfer (multipart upload, parallel ranged GETs)
    tuned by `TransferConfig`; every request is retried by botocore's retry handler (standard
    mode: exponential backoff with jitter on throttling, 5xx and connection errors).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        *,
        max_attempts: int | None = None,
        retry_mode: str | None = None,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        max_concurrency: int = 8,
        client: Any = None,
    ):
        if not bucket:
            raise ValueError("S3ObjectStore needs a bucket name")
        env = os.environ
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or env.get("ARDIT_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL") or None
        self.region = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.max_attempts = int(max_attempts or env.get("ARDIT_S3_MAX_ATTEMPTS") or DEFAULT_MAX_ATTEMPTS)
        self.retry_mode = retry_mode or env.get("ARDIT_S3_RETRY_MODE") or "standard"
        self.multipart_threshold = multipart_threshold
        self.multipart_chunksize = multipart_chunksize
        self.max_concurrency = max_concurrency
        self._client = client

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.url()!r}, endpoint_url={self.endpoint_url!r})"

    @property
    def client(self) -> Any:
        """The boto3 client (created on first use, so importing this module needs no boto3)."""
        if self._client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError as exc:
                from components.errors import missing_extra

                raise (missing_extra(exc, f"S3 storage ({self.url()})") or exc) from None

            config = Config(
                region_name=self.region,
                # total_max_attempts counts the first try too (botocore's max_attempts does not).
                # the longer waits between its rounds are `_call`'s
                retries={"total_max_attempts": self._round_attempts, "mode": self.retry_mode},
                # Custom endpoints (SeaweedFS, MinIO, ...) rarely have per-bucket DNS names.
                s3={"addressing_style": "path" if self.endpoint_url else "auto"},
                connect_timeout=10,
                read_timeout=120,
            )
            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint_url, config=config)
        return self._client

    @property
    def _round_attempts(self) -> int:
        return max(1, min(self.max_attempts, QUICK_ATTEMPTS))

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.multipart_chunksize,
            max_concurrency=self.max_concurrency,
        )

    def _key(self, key: str) -> str:
        return join_key(self.prefix, check_key(key))

    def _error(self, op: str, key: str, exc: Exception, attempts: int | None = None,
               seconds: float | None = None) -> ObjectStoreError:
        """Turn a botocore error into one that says what was being done, where, and why (and, for a
        passing failure, after how many failed attempts over how long)."""
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        where = self.url(key) if key else self.url()
        endpoint = self.endpoint_url or "AWS"
        over = f" over {seconds:.0f} s" if seconds is not None and seconds >= 1 else ""
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            retries = (attempts or 1) - 1 if attempts is not None else \
                exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
            if code == "NoSuchBucket" or (op == "head bucket" and code in ("404", "NotFound")):
                return BucketNotFoundError(f"S3 bucket {self.bucket!r} does not exist [endpoint {endpoint}]: "
                                           f"create it (aws s3 mb s3://{self.bucket}) or fix the URI {where}")
            if code in ("404", "NoSuchKey", "NotFound"):
                return ObjectNotFoundError(f"no object {where}")
            msg = (
                f"S3 {op} {where} failed: {code or status} (HTTP {status}) {err.get('Message', '')}".rstrip()
                + f" after {retries + 1} attempt(s){over} [endpoint {endpoint}]"
            )
            if status == 403 or code in _AUTH_CODES:
                return S3AccessError(f"{msg}: the credentials were refused or lack permission; {_CREDENTIALS_HINT}")
            if status in _TRANSIENT_STATUS or code in _TRANSIENT_CODES:
                return TransientStorageError(msg)
            return ObjectStoreError(msg)
        if isinstance(exc, NoCredentialsError):
            return S3AccessError(f"S3 {op} {where}: no credentials found; {_CREDENTIALS_HINT}")
        if isinstance(exc, EndpointConnectionError):
            tries = f" after {attempts} attempt(s){over}" if attempts is not None else ""
            return TransientStorageError(f"S3 {op} {where}: cannot reach the endpoint {endpoint} ({exc}){tries}; "
                                         "check ARDIT_S3_ENDPOINT / AWS_ENDPOINT_URL")
        error = TransientStorageError if is_transient(exc) else ObjectStoreError
        tries = f" after {attempts} attempt(s){over}" if attempts is not None and error is TransientStorageError \
            else ""
        return error(f"S3 {op} {where} failed: {type(exc).__name__}: {exc}{tries} [endpoint {endpoint}]")

    def _call(self, op: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) with botocore's errors made clear; a passing failure is retried in
        rounds of botocore's quick attempts, `ROUND_BACKOFF_S` apart, until `max_attempts` failed."""
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        failed, rounds, t0 = 0, 0, time.monotonic()
        while True:
            try:
                result = fn(*args, **kwargs)
                if failed:  # and the last round's own retries, where the answer says (not a managed transfer's)
                    last = result.get("ResponseMetadata", {}).get("RetryAttempts") if isinstance(result, dict) \
                        else None
                    count = f"{failed + last}" if last is not None else f"at least {failed}"
                    print(f"S3 {op} {self.url(key) if key else self.url()}: succeeded after {count} failed "
                          f"attempt(s) over {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
                return result
            except (ClientError, BotoCoreError, Boto3Error) as exc:
                cause: Any = exc
                if isinstance(exc, Boto3Error):  # managed transfers wrap the botocore error (S3UploadFailedError)
                    inner = getattr(exc, "last_exception", None) or exc.__context__
                    cause = inner if isinstance(inner, (ClientError, BotoCoreError)) else exc
                failed += self._attempts_of(cause)
                error = self._error(op, key, cause, failed, time.monotonic() - t0)
                if not isinstance(error, TransientStorageError) or failed >= self.max_attempts:
                    raise error from exc
                if rounds == 0:  # say why nothing happens for a while (a mistyped endpoint waits it all out)
                    print(f"S3 {op} {self.url(key) if key else self.url()}: {type(cause).__name__}; retrying "
                          f"for up to {self.max_attempts} attempts (ARDIT_S3_MAX_ATTEMPTS)", file=sys.stderr, flush=True)
            time.sleep(ROUND_BACKOFF_S[min(rounds, len(ROUND_BACKOFF_S) - 1)] * random.uniform(0.75, 1.25))
            rounds += 1

    def _attempts_of(self, exc: Any) -> int:
        """How many attempts botocore made of a request that failed with `exc`."""
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            return int(exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)) + 1
        return self._round_attempts  # a connection error: botocore retried it the whole round

    def put_bytes(self, key: str, data: bytes) -> None:
        if len(data) < self.multipart_threshold:  # one PutObject: atomic, retried by botocore
            self._call("put", key, self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data)
            return
        # Managed multipart upload: the object appears only when the upload completes, and
        # s3transfer aborts the upload on failure, so there is never a partial object.
        # (a fresh reader for each try: a retry must not start where the failed upload stopped)
        self._call("put", key, lambda: self.client.upload_fileobj(io.BytesIO(data), self.bucket, self._key(key),
                                                                  Config=self._transfer_config()))

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        self._call("put", key, self.client.upload_file, os.fspath(path), self.bucket, self._key(key),
                   Config=self._transfer_config())

    def get_bytes(self, key: str) -> bytes:
        def download() -> bytes:  # into a fresh buffer each try: a failed one may have written part
            buf = io.BytesIO()
            self.client.download_fileobj(self.bucket, self._key(key), buf, Config=self._transfer_config())
            return buf.getvalue()

        return self._call("get", key, download)

    def get_file(self, key: str, path: str | os.PathLike[str]) -> None:
        # download_file writes to a temp name and renames, so `path` is never half-written.
        self._call("get", key, self.client.download_file, self.bucket, self._key(key), os.fspath(path),
                   Config=self._transfer_config())

    def _head(self, key: str) -> dict[str, Any]:
        return self._call("head", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
            return True
        except ObjectNotFoundError:
            return False

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        # botocore retries the request, not the body: a connection reset or a short body while
        # reading it is retried here, with the same attempts and backoff as a failed request.
        for attempt in range(1, self.max_attempts + 1):
            resp = self._call("get", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key),
                              Range=f"bytes={start}-{start + length - 1}")
            try:
                data = resp["Body"].read()
                expected = int(resp.get("ContentLength", len(data)))
                if len(data) == expected:
                    return data
                problem = f"truncated body: {len(data)} of {expected} bytes"
            except _streaming_errors() as exc:
                problem = f"{type(exc).__name__}: {exc}"
            finally:
                resp["Body"].close()
            if attempt == self.max_attempts:
                raise TransientStorageError(f"S3 get {self.url(key)} bytes {start}+{length} failed while reading "
                                       f"the body ({problem}) after {attempt} attempt(s) "
                                       f"[endpoint {self.endpoint_url or 'AWS'}]")
            time.sleep(min(20.0, random.uniform(0, 2 ** attempt * 0.1)))  # botocore's standard backoff
        raise AssertionError("unreachable")

    def content_id(self, key: str) -> str:
        head = self._head(key)
        return f"etag:{head['ETag'].strip(chr(34))}:size:{head['ContentLength']}"

    def list(self, prefix: str = "") -> list[str]:
        full = join_key(self.prefix, prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        paginator = self.client.get_paginator("list_objects_v2")

        def list_all() -> list[str]:
            keys: list[str] = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
            return keys

        keys = self._call("list", prefix.rstrip("/"), list_all)
        return sorted(k for k in keys if k and not k.endswith("/"))

    def delete(self, key: str) -> None:
        self._call("delete", key, self.client.delete_object, Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise ValueError("delete_prefix needs a non-empty prefix (refusing to empty the store)")
        keys = self.list(prefix)
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            resp = self._call("delete", prefix, self.client.delete_objects, Bucket=self.bucket,
                              Delete={"Objects": batch, "Quiet": True})
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise ObjectStoreError(
                    f"S3 delete_prefix {self.url(prefix)}: {len(resp['Errors'])} key(s) not deleted, "
                    f"first {first.get('Key')}: {first.get('Code')} {first.get('Message', '')}"
                )
        return len(keys)

    def url(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{join_key(self.prefix, key) if key else self.prefix}".rstrip("/")

    def check_access(self, write: bool = True) -> None:
        """Before any work: the bucket exists, the credentials work, and (with `write`) a probe
        object can be written and deleted under the prefix. Raises one clear error otherwise."""
        self._call("head bucket", "", self.client.head_bucket, Bucket=self.bucket)
        self._call("list", "", self.client.list_objects_v2, Bucket=self.bucket,
                   Prefix=self.prefix + "/" if self.prefix else "", MaxKeys=1)
        if write:
            probe = f"{_TMP_PREFIX.lstrip('.')}probe-{uuid.uuid4().hex[:12]}"
            self.put_bytes(probe, b"")
            self.delete(probe)

    def child(self, prefix: str) -> S3ObjectStore:
        if not prefix:
            return self
        store = S3ObjectStore(
            self.bucket, self._key(prefix), self.endpoint_url, self.region,
            max_attempts=self.max_attempts, retry_mode=self.retry_mode,
            multipart_threshold=self.multipart_threshold, multipart_chunksize=self.multipart_chunksize,
            max_concurrency=self.max_concurrency, client=self._client,
        )
        return store


def is_s3_uri(uri: str) -> bool:
    return str(uri).startswith("s3://")


def split_uri(uri: str) -> tuple[str, str]:
    """`s3://b/a/x.parquet` -> (`s3://b/a`, `x.parquet`); `/d/x.parquet` -> (`/d`, `x.parquet`);
    `/x.parquet` -> (`/`, `x.parquet`); `x.parquet` -> (`.`, `x.parquet`)."""
    uri = str(uri).rstrip("/")
    head, slash, tail = uri.rpartition("/")
    if is_s3_uri(uri) and head in ("s3:/", "s3:"):
        raise ValueError(f"{uri!r} names a bucket, not an object")
    return (head or slash or "."), tail  # a file at the root lives in "/", not in the working directory


def open_object_store(uri: str | os.PathLike[str], **s3_options: Any) -> ObjectStore:
    """`s3://bucket/prefix` -> S3ObjectStore; a plain path or `file://` URI -> LocalObjectStore."""
    text = os.fspath(uri)
    if text.startswith("s3://"):
        parsed = urlparse(text)
        if not parsed.netloc:
            raise ValueError(f"S3 URI {text!r} has no bucket")
        return S3ObjectStore(parsed.netloc, parsed.path.strip("/"), **s3_options)
    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI {text!r} names a remote host")
        return LocalObjectStore(unquote(parsed.path))
    if "://" in text:
        raise ValueError(f"unsupported object store URI {text!r} (use a path, file:// or s3://)")
    return LocalObjectStore(text)
