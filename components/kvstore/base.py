"""The one KV store interface the AR and DiT steps use, and `open_store(url)`.

A get never waits for a payload to appear: the AR step of a shard has finished (and put every
key) before its DiT step starts, so "not there now" means "recompute", returned at once with the
reason. Only a transfer that hangs is bounded, by the store's timeout.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

from components.engine.kvcache import PromptKV
from components.kvstore.payload import PayloadError

if TYPE_CHECKING:  # typing.Self needs Python 3.11
    from typing_extensions import Self

# Key parts: letters, digits, '.', '_', '-' (no '#': the mooncake backend uses it for part keys).
_PART = re.compile(r"^[A-Za-z0-9._-]+$")
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


def check_key(key: str) -> str:
    """Keys look like `{run}/{shard}/{row}`: '/'-separated parts of [A-Za-z0-9._-]."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"store key must be a non-empty string, got {key!r}")
    if len(key) > MAX_KEY_LEN:
        raise ValueError(
            f"store key {key[:40]!r}... is longer than {MAX_KEY_LEN} characters"
        )
    for part in key.split("/"):
        if not _PART.match(part) or part in (".", ".."):
            raise ValueError(
                f"store key {key!r}: part {part!r} must be non-empty [A-Za-z0-9._-] and not '.'/'..'"
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
        """Payload keys (sorted) equal to `prefix` or under `prefix/`; all if empty."""

    @abstractmethod
    def health(self) -> Health: ...

    def close(self) -> None:
        pass

    # batch forms; backends override where the store has a native one
    def put_many(self, items: Iterable[tuple[str, PromptKV | Any]]) -> list[int]:
        return [self.put(k, v) for k, v in items]

    def get_many(
        self,
        keys: Iterable[str],
        expect_model_id: str | None = None,
        expect_config_hash: str | None = None,
    ) -> list[GetResult]:
        return [self.get(k, expect_model_id, expect_config_hash) for k in keys]

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


def under_prefix(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + "/")


def parse_query(url: str) -> tuple[Any, dict[str, str]]:
    u = urlparse(url)
    q = {}
    for k, v in parse_qs(u.query, keep_blank_values=True).items():
        if len(v) != 1:
            raise ValueError(f"store url {url!r}: parameter {k!r} given {len(v)} times")
        q[k] = v[0]
    return u, q


def open_store(url: str | None = None) -> KVStore:
    """`local:///dir` or a plain path -> LocalStore; `mooncake://HOST:PORT?...` -> MooncakeStore."""
    if not url:
        raise ValueError(
            "store url is empty (use local:///path or mooncake://host:port?metadata=...)"
        )
    if url.startswith("mooncake://"):
        from components.kvstore.mooncake import (
            MooncakeStore,  # lazy: needs the mooncake wheel
        )

        return MooncakeStore.from_url(url)
    if url.startswith("local://"):
        u, q = parse_query(url)
        if q:
            raise ValueError(
                f"store url {url!r}: local:// takes no parameters, got {sorted(q)}"
            )
        path = unquote(u.netloc + u.path)
    elif "://" in url:
        raise ValueError(
            f"store url {url!r}: unknown scheme (use local:// or mooncake://)"
        )
    else:
        path = url
    from components.kvstore.local import LocalStore

    return LocalStore(path)
