"""The one KV store interface the AR and DiT steps use (backends: local.py, mooncake.py;
`open_store(url)` in factory.py picks one).

A get never waits for a payload to appear: the AR step of a shard has finished (and put every
key) before its DiT step starts, so "not there now" means "recompute", returned at once with the
reason. Only a transfer that hangs is bounded, by the store's timeout.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:  # only for annotations: importing this module must not import torch
    from typing_extensions import Self  # typing.Self needs Python 3.11

    from components.engine.kvcache import PromptKV
    from components.kvstore.payload import PayloadError

# Key parts: letters, digits, '.', '_', '-', '~' (no '#': the mooncake backend uses it for part
# keys). Row ids that are not plain reach here encoded by `runs.row_key` (`name~hash`).
_PART = re.compile(r"^[A-Za-z0-9._~-]+$")
MAX_KEY_LEN = 512

# GetResult.reason codes (a detail may follow after ": ")
OK = "ok"
MISSING = "missing"
CHECKSUM = "checksum_mismatch"
MODEL = "model_mismatch"
CONFIG = "config_mismatch"
CORRUPT = "corrupt"
TIMEOUT = "timeout"
UNREACHABLE = "unreachable"


@dataclass
class GetResult:
    """kv is None when absent; `reason` says why ("missing", "checksum_mismatch: ...", ...)."""

    kv: PromptKV | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.kv is not None

    @property
    def code(self) -> str:
        return self.reason.split(":", 1)[0]


@dataclass
class Health:
    ok: bool
    detail: str


class StoreError(RuntimeError):
    """A put/delete that the store refused or could not do (full, unreachable, bad key)."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int, what: str) -> int:
    """'256MB', '1 GiB', '1048576' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{what}: {text!r} is not a size (e.g. 512MB, 2GB, 1048576)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()[:1]])


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | float, what: str) -> float:
    """'6h', '30m', '90s', '500ms', '3600' -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _DURATION_RE.match(str(text))
    if not m:
        raise ValueError(f"{what}: {text!r} is not a duration (e.g. 6h, 30m, 90s, 3600)")
    return float(m.group(1)) * _DURATION_UNITS[(m.group(2) or "").lower()]


def check_key(key: str) -> str:
    """Keys look like `{run}/{shard}/{row}`: '/'-separated parts of [A-Za-z0-9._~-]."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"store key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LEN:
        raise ValueError(
            f"store key {key[:40]!r}... is longer than {MAX_KEY_LEN} characters"
        )
    for part in key.split("/"):
        if not _PART.match(part) or part in (".", ".."):
            raise ValueError(
                f"store key {key!r}: part {part!r} must be non-empty [A-Za-z0-9._~-] and not '.'/'..'"
            )
    return key


def make_key(run: str, shard: int | str, row: int | str) -> str:
    return check_key(f"{run}/{shard}/{row}")


class KVStore(ABC):
    """put / get / exists / delete / delete_prefix / expire / keys / health.

    `put` takes a PromptKV (encoded by the store into its own buffer) or an already encoded
    payload (bytes-like). `get` checks checksum and, if given, model id and config hash.
    """

    url: str
    ttl_s: float | None = None  # payloads older than this may be expired (None: kept until deleted)

    @abstractmethod
    def put(self, key: str, kv: PromptKV | Any) -> int:
        """Store a payload; returns its size in bytes. Raises StoreError if the store refuses."""

    @abstractmethod
    def get(
        self,
        key: str,
        expect_model_id: str | None = None,
        expect_config_hash: str | None = None,
        device: str | None = None,
    ) -> GetResult:
        """The PromptKV, or None with the reason. Never raises for absent/corrupt/unreachable."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes | None:
        """The raw payload bytes (no checks), None if missing. For tools and tests."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove one payload; True if something was removed."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove `prefix` itself and every key under `prefix/` (a run: `delete_prefix(run)`)."""

    @abstractmethod
    def expire(self, older_than_s: float) -> int:
        """Remove payloads put more than `older_than_s` seconds ago; returns how many."""

    @abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """Payload keys (sorted) that start with `prefix` (a plain string prefix, as
        `ardit store keys --prefix`; `run/` for exactly one run); all if empty."""

    def orphaned_parts(self, prefix: str = "") -> list[str]:
        """Stored objects that belong to no payload (the parts or temp files of a put that never
        finished); `expire` removes them with the payloads of their age."""
        return []

    @abstractmethod
    def health(self) -> Health: ...

    def close(self) -> None:
        pass

    # batch form; backends override where the store has a native one
    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reason_for(e: PayloadError) -> str:
    """A GetResult reason for a payload error: checksum/model/config codes, anything else corrupt."""
    code = {
        "checksum_mismatch": CHECKSUM,
        "model_mismatch": MODEL,
        "config_mismatch": CONFIG,
    }.get(e.reason)
    return f"{code}: {e.detail}" if code else f"{CORRUPT}: {e.reason}: {e.detail}"


def parse_query(url: str) -> tuple[Any, dict[str, str]]:
    u = urlparse(url)
    q = {}
    for k, v in parse_qs(u.query, keep_blank_values=True).items():
        if len(v) != 1:
            raise ValueError(f"store url {url!r}: parameter {k!r} given {len(v)} times")
        q[k] = v[0]
    return u, q


def delete_quietly(store: KVStore, key: str, *, prefix: bool = False, attempts: int = 3,
                   backoff_s: float = 0.5) -> str | None:
    """Delete a payload (or, with `prefix`, everything under it), retrying a store that is
    restarting; never raises. Returns None, or why it could not be deleted (the payload then
    waits for its TTL or `ardit store clean`)."""
    import time

    error = None
    for attempt in range(attempts):
        try:
            (store.delete_prefix if prefix else store.delete)(key)
            return None
        except Exception as exc:  # noqa: BLE001 - deleting a consumed payload must never sink a row
            error = f"{type(exc).__name__}: {exc}"
            if attempt + 1 < attempts:
                time.sleep(backoff_s * 2**attempt)
    return error


class DaemonPool:
    """``n`` daemon threads running submitted calls (with n=1: in order). A stand-in for
    ThreadPoolExecutor, whose threads the interpreter joins at exit: a call hung in a frozen store
    server would hold the step's process long after its commit. Here it is abandoned with it."""

    def __init__(self, n: int = 1, name: str = "kv-io"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"{name}_{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    fut.set_exception(e)

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> bool:
        """Stop after the queued calls; with `wait`, wait for them (at most `timeout` s). True if stopped."""
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            end = None if timeout is None else time.monotonic() + timeout
            for t in self._threads:
                t.join(None if end is None else max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)
